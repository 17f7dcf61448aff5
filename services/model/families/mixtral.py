"""Mixtral: Llama's attention and a mixture of SwiGLU experts in every layer (`block_sparse_moe`,
experts' products named w1, w3, w2), softmax routing renormalized over the top k."""

from __future__ import annotations

from typing import Any

from services.model.config import ModelConfig, MoeShape
from services.model.families.family import Family
from services.model.families.llama import decoder_config, decoder_shapes, refuse


def read_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    if raw.get("router_jitter_noise"):
        refuse(raw, "router_jitter_noise", "noise is for training")
    moe = MoeShape(
        num_experts=int(raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["intermediate_size"]),
        layers=tuple(range(int(raw["num_hidden_layers"]))),
        norm_topk_prob=True,
        prefix="block_sparse_moe",
    )
    return decoder_config(raw, model_type, moe=moe)


FAMILY = Family(
    name="mixtral",
    architectures={"MixtralForCausalLM": "mixtral"},
    read_config=read_config,
    expected_shapes=decoder_shapes,
    model="services.model.families.llama.model:DecoderModel",
)
