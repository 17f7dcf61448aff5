"""Read a Llama-family GGUF: config from its metadata, tensors dequantized to float32.

Tensors come out under Hugging Face names and in Hugging Face layout. llama.cpp's converter
permutes the rows of q_proj and k_proj so that RoPE rotates adjacent pairs; we undo that, so the
weights work with the rotate-half RoPE that transformers (and our forward pass) use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from services.model.config import ModelConfig, RopeScaling
from services.model.errors import ModelLoadError
from services.model.loading.weights import check_complete, check_shapes

GGUF_MAGIC = b"GGUF"

# Tensor types we dequantize (all are handled by gguf.quants and covered by tests).
SUPPORTED_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K"}
    | {"Q5_K", "Q6_K"}
)

# GGUF architectures and whether llama.cpp permuted their q/k rows.
ARCHITECTURES = {"llama": True, "mistral": True, "qwen2": False}

LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class GGUFModel:
    """What a GGUF holds, translated: config, HF-named float32 tensors, tokenizer metadata."""

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]  # every scalar / array field, by GGUF key


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf(path: Path) -> GGUFModel:
    """Parse, validate and dequantize a GGUF file; every failure is a ModelLoadError."""
    import gguf  # imported here: parsing the package's tables costs start-up time

    if not path.is_file():
        raise ModelLoadError(path, "no such file")
    if not is_gguf(path):
        raise ModelLoadError(path, "not a GGUF file (bad magic)")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueErrors and struct errors
        raise ModelLoadError(path, f"corrupt GGUF: {e}") from e
    metadata = {key: _field_value(field) for key, field in reader.fields.items()}
    config = config_from_metadata(path, metadata)
    names = {hf_name(path, t.name) for t in reader.tensors}
    if "lm_head.weight" in names:
        config = replace(config, tie_word_embeddings=False)
    permuted = ARCHITECTURES[metadata["general.architecture"]]
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(path, t.name)
        tensor = _dequantize(path, t, gguf)
        check_shapes(path, config, {name: tensor.shape})
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = unpermute_rope_rows(
                tensor, config.num_heads if "q_proj" in name else config.num_kv_heads
            )
        tensors[name] = tensor
    check_complete(path, config, tensors)
    return GGUFModel(config=config, tensors=tensors, metadata=metadata)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, interleaved pairs -> two halves."""
    half = w.shape[0] // num_heads // 2
    # w rows: [heads, half, 2] (pairs adjacent) -> [heads, 2, half] (halves)
    return np.ascontiguousarray(
        w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def hf_name(path: Path, gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise ModelLoadError(path, f"unexpected tensor {gguf_name!r} for this architecture")


def config_from_metadata(path: Path, md: dict[str, Any]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (supported: {supported})")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            raise ModelLoadError(path, f"metadata key {full!r} is missing")
        return md[full]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ModelLoadError(path, "vocabulary size is missing from the metadata")
    eos = md.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings=True,  # until an output.weight tensor says otherwise
        attention_bias=arch == "qwen2",
        bos_token_id=_opt_int(md.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=() if eos is None else (int(eos),),
        rope_scaling=_rope_scaling(path, arch, md),
        name=str(md.get("general.name", path.stem)),
    )


def _rope_scaling(path: Path, arch: str, md: dict[str, Any]) -> RopeScaling | None:
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(md[f"{arch}.rope.scaling.factor"]))
    raise ModelLoadError(path, f"unsupported RoPE scaling {kind!r} (supported: none, linear)")


def _dequantize(path: Path, tensor: Any, gguf: Any) -> np.ndarray:
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(SUPPORTED_TYPES))
        raise ModelLoadError(
            path,
            f"tensor {tensor.name!r} has unsupported quantization type {kind} "
            f"(supported: {supported})",
        )
    try:
        out = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise ModelLoadError(path, f"tensor {tensor.name!r} cannot be dequantized: {e}") from e
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # a field the reader cannot decode is not one we need
        return None


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)
