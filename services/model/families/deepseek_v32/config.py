"""DeepSeek-V3.2's shape as transformers reads its config.json (`DeepseekV32Config`): DeepSeek-V3
(latent attention, experts after the first dense layers) plus, in every layer, a lightning
indexer that picks the `index_topk` earlier tokens each query attends to (DeepSeek Sparse
Attention). Its cache is two groups: each layer's latent and rotary key (576 elements for
V3.2's own shape), and each layer's indexer key (`index_head_dim`), both kept for good."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from services.model.cache_spec import CacheGroup, CacheSpec
from services.model.config import ModelConfig
from services.model.families.deepseek.config import (
    MlaShape,
    read_mla,
    read_moe,
)
from services.model.families.deepseek.config import (
    expected_shapes as deepseek_shapes,
)
from services.model.families.deepseek.config import read_config as read_deepseek
from services.model.families.llama import Shapes, refuse

LATENT, INDEXER = "latent", "indexer"  # the cache groups
MLP_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class V32Shape(MlaShape):
    """Latent attention with the indexer's shape: its heads, their width, how many tokens it
    picks per query."""

    index_heads: int = 64
    index_dim: int = 128
    index_topk: int = 2048


def v32_of(config: ModelConfig) -> V32Shape:
    assert isinstance(config.shape, V32Shape), "not a DeepSeek-V3.2 config"
    return config.shape


def cache_spec(layers: int, shape: V32Shape) -> CacheSpec:
    """Per layer one row of K: the latent and rotary key, then the indexer's key; no V."""
    latent, width = shape.latent_dim, shape.latent_dim + shape.index_dim
    every = tuple(range(layers))
    groups = (
        CacheGroup(LATENT, every, (0, latent), (0, 0)),
        CacheGroup(INDEXER, every, (latent, width), (0, 0)),
    )
    return CacheSpec(layers, 1, width, 0, groups, row_layout="v3.2: latent, then indexer key")


def read_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    if raw.get("q_lora_rank") is None:
        refuse(raw, "q_lora_rank", "DeepSeek-V3.2's queries pass through q_a_proj (q_lora_rank)")
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        dense = min(int(raw.get("first_k_dense_replace") or 0), layers)
        kinds = ["dense"] * dense + ["sparse"] * (layers - dense)
    if len(kinds) != layers or any(k not in MLP_TYPES for k in kinds):
        refuse(raw, "mlp_layer_types", f"one of {', '.join(MLP_TYPES)} for each of {layers}")
    shape = read_mla(
        raw,
        V32Shape,
        index_heads=int(raw.get("index_n_heads") or 64),
        index_dim=int(raw.get("index_head_dim") or 128),
        index_topk=int(raw.get("index_topk") or 2048),
    )
    assert isinstance(shape, V32Shape)
    if shape.index_dim < shape.rope_dim or shape.index_dim % 2:
        refuse(raw, "index_head_dim", "the indexer's keys rotate their first qk_rope_head_dim")
    experts = [i for i, kind in enumerate(kinds) if kind == "sparse"]
    base = read_deepseek(raw, "deepseek_v3")  # MLA, experts, YaRN and V3's refusals
    return dataclasses.replace(
        base,
        architecture=model_type,
        moe=read_moe(raw, "deepseek_v3", experts),
        shape=shape,
        cache=cache_spec(layers, shape),
        name=str(raw.get("_name_or_path") or model_type),
    )


def expected_shapes(c: ModelConfig) -> Shapes:
    shape, h = v32_of(c), c.hidden_size
    assert shape.q_lora_rank is not None
    shapes = deepseek_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}.self_attn.indexer."
        shapes |= {
            p + "wq_b.weight": (shape.index_heads * shape.index_dim, shape.q_lora_rank),
            p + "wk.weight": (shape.index_dim, h),
            p + "k_norm.weight": (shape.index_dim,),
            p + "k_norm.bias": (shape.index_dim,),
            p + "weights_proj.weight": (shape.index_heads, h),
        }
    return shapes
