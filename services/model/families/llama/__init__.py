"""Llama and the decoders built like it: Llama, Mistral, Qwen2 and Qwen3. Grouped-query
attention (one K and V per KV head, rotate-half rope; Qwen2's q/k/v biases, Qwen3's per-head
q/k norms), a SwiGLU MLP, RMS norms before each block. The embedded model is one (SmolLM2,
from a GGUF: families/llama/gguf.py).

The helpers here read and name what every decoder of this build shares; the families that
change only the MLP (mixtral.py, qwen_moe.py) or the attention (deepseek/) use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.families.family import Family
from services.model.loading.hf_fields import eos_ids, fp8_block, rope_scaling
from services.model.loading.shapes import embedding_shapes

Shapes = dict[str, tuple[int, ...]]


def refuse(raw: dict[str, Any], field: str, why: str) -> None:
    raise ModelLoadError("config.json", f"unsupported {field}={raw.get(field)!r}: {why}")


def check_swiglu(raw: dict[str, Any]) -> None:
    """The MLP's activation is SiLU and its products have no bias."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError("config.json", f"unsupported hidden_act {raw['hidden_act']!r}")
    if raw.get("mlp_bias"):
        raise ModelLoadError("config.json", "unsupported mlp_bias=true")


def decoder_config(raw: dict[str, Any], model_type: str, **fields: Any) -> ModelConfig:
    """A ModelConfig from the fields every decoder of this build has; `fields` overrides or
    adds (the experts, the attention's biases, the family's shape)."""
    check_swiglu(raw)
    heads = int(raw["num_attention_heads"])
    rope = dict(raw.get("rope_parameters") or {})
    # transformers 5 writes rope_parameters; older configs rope_theta and rope_scaling
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type") != "default" else None)
    window = raw.get("sliding_window")
    values: dict[str, Any] = dict(
        architecture=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw),
        rope_scaling=rope_scaling(scaling),
        sliding_window=int(window) if window else None,
        fp8_block=fp8_block(raw.get("quantization_config")),
        name=str(raw.get("_name_or_path") or model_type),
    )
    return ModelConfig(**(values | fields))


def read_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    qwen = model_type in ("qwen2", "qwen3")
    if model_type == "qwen3" and raw.get("use_sliding_window"):
        refuse(raw, "use_sliding_window", "sliding-window layers are served for Mistral only")
    fields: dict[str, Any] = {"qk_norm": model_type == "qwen3"}
    if qwen and not raw.get("use_sliding_window"):
        fields["sliding_window"] = None
    if model_type == "qwen2":
        fields["attention_bias"] = bool(raw.get("qkv_bias", True))
    return decoder_config(raw, model_type, **fields)


def mlp_shapes(p: str, hidden: int, ff: int, names: tuple[str, str, str] | None = None) -> Shapes:
    """A SwiGLU MLP's gate, up and down projections (Mixtral's experts call them w1, w3, w2)."""
    gate, up, down = names or ("gate_proj", "up_proj", "down_proj")
    return {
        f"{p}{gate}.weight": (ff, hidden),
        f"{p}{up}.weight": (ff, hidden),
        f"{p}{down}.weight": (hidden, ff),
    }


def gqa_shapes(c: ModelConfig, p: str) -> Shapes:
    h, kv, q = c.hidden_size, c.kv_size, c.q_size
    shapes: Shapes = {
        p + "q_proj.weight": (q, h),
        p + "k_proj.weight": (kv, h),
        p + "v_proj.weight": (kv, h),
        p + "o_proj.weight": (h, q),
    }
    if c.attention_bias:
        shapes |= {p + "q_proj.bias": (q,), p + "k_proj.bias": (kv,), p + "v_proj.bias": (kv,)}
    if c.qk_norm:
        shapes |= {p + "q_norm.weight": (c.head_dim,), p + "k_norm.weight": (c.head_dim,)}
    return shapes


def moe_shapes(c: ModelConfig, p: str) -> Shapes:
    """A mixture's router, experts and shared experts, named as its MoeShape says."""
    moe, h = c.moe, c.hidden_size
    assert moe is not None
    p += moe.prefix + "."
    shapes: Shapes = {p + "gate.weight": (moe.num_experts, h)}
    if moe.topk_method == "noaux_tc":
        shapes[p + "gate.e_score_correction_bias"] = (moe.num_experts,)
    names = ("w1", "w3", "w2") if moe.prefix == "block_sparse_moe" else None
    for e in range(moe.num_experts):
        shapes |= mlp_shapes(f"{p}experts.{e}.", h, moe.intermediate_size, names)
    if moe.shared_intermediate_size:
        shared = "shared_expert." if moe.shared_gate else "shared_experts."
        shapes |= mlp_shapes(p + shared, h, moe.shared_intermediate_size)
    if moe.shared_gate:
        shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes


def decoder_shapes(
    c: ModelConfig, attention: Callable[[ModelConfig, str], Shapes] = gqa_shapes
) -> Shapes:
    """Hugging Face tensor names and shapes: embeddings, then per layer two norms, the
    attention's (`attention`) and a dense or mixture MLP's."""
    h = c.hidden_size
    shapes = embedding_shapes(c.vocab_size, h, c.tie_word_embeddings)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes |= attention(c, p + "self_attn.")
        if c.is_moe_layer(i):
            shapes |= moe_shapes(c, p)
        else:
            shapes |= mlp_shapes(p + "mlp.", h, c.intermediate_size)
    return shapes


def to_hf(c: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers (and vLLM) load as this architecture (the GGUF
    families: llama, mistral, qwen2)."""
    arch_class = {v: k for k, v in FAMILY.architectures.items()}
    eos: int | list[int] | None = list(c.eos_token_ids) or None
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    out: dict[str, Any] = {
        "architectures": [arch_class[c.architecture]],
        "model_type": c.architecture,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling.to_hf() if c.rope_scaling else None,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if c.architecture == "llama":
        out["attention_bias"] = c.attention_bias
        out["mlp_bias"] = False
    if c.architecture == "mistral":
        out["sliding_window"] = c.sliding_window
    return out


FAMILY = Family(
    name="llama",
    architectures={
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    },
    read_config=read_config,
    expected_shapes=decoder_shapes,
    model="services.model.families.llama.model:DecoderModel",
)
