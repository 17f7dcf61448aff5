"""Writing small GGUF files for tests, the way llama.cpp's converter writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (halves -> adjacent pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER[rest]}"


def write_llama_gguf(
    path: Path,
    model: torch.nn.Module,
    tokenizer_md: dict[str, Any] | None,
    arch: str = "llama",
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    overrides: dict[str, int] | None = None,
) -> None:
    """A GGUF of a transformers Llama model. `types` quantizes chosen tensors; `raw` replaces
    a tensor's bytes and type outright; `overrides` changes integer metadata."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch=arch)
    ints = {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size,
    } | (overrides or {})
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    if tokenizer_md is not None:  # without one the file still reads, but cannot be served
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer_md["tokenizer.ggml.pre"])
        w.add_token_list(tokenizer_md["tokenizer.ggml.tokens"])
        w.add_token_types(tokenizer_md["tokenizer.ggml.token_type"])
        w.add_token_merges(tokenizer_md["tokenizer.ggml.merges"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(tokenizer_md["tokenizer.chat_template"])
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(hf)
        data = tensor.float().numpy()
        if hf.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        if hf.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        if raw and name in raw:
            blob, kind = raw[name]
            w.add_tensor(name, blob, raw_dtype=kind)
        elif types and name in types:
            w.add_tensor(name, gguf.quants.quantize(data, types[name]), raw_dtype=types[name])
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
