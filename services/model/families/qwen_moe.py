"""Qwen2-MoE and Qwen3-MoE: Qwen's attention (Qwen2's q/k/v biases, Qwen3's per-head q/k
norms) and experts in every `decoder_sparse_step`-th layer not listed dense; Qwen2-MoE adds a
shared expert scaled by sigmoid(gate(x))."""

from __future__ import annotations

from typing import Any

from services.model.config import ModelConfig, MoeShape
from services.model.families.family import Family
from services.model.families.llama import decoder_config, decoder_shapes, refuse


def read_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    if raw.get("use_sliding_window"):
        refuse(raw, "use_sliding_window", "sliding-window layers are served for Mistral only")
    qwen2 = model_type == "qwen2_moe"
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    layers = range(int(raw["num_hidden_layers"]))
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if qwen2 else 0
    moe = MoeShape(
        num_experts=experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        layers=tuple(i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_gate=shared > 0,
    )
    return decoder_config(
        raw,
        model_type,
        moe=moe,
        sliding_window=None,
        qk_norm=not qwen2,
        attention_bias=bool(raw.get("qkv_bias", True))
        if qwen2
        else bool(raw.get("attention_bias")),
    )


FAMILY = Family(
    name="qwen_moe",
    architectures={"Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"},
    read_config=read_config,
    expected_shapes=decoder_shapes,
    model="services.model.families.llama.model:DecoderModel",
)
