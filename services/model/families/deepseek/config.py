"""DeepSeek-V2 and V3's shape as transformers reads their config.json: multi-head latent
attention (MLA) and mixtures of experts after the first dense layers (group-limited routing,
V3's noaux_tc over sigmoid scores with a correction bias), shared experts, YaRN."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.model.cache_spec import CacheSpec
from services.model.config import SCORING, TOPK_METHODS, ModelConfig, MoeShape
from services.model.families.llama import Shapes, decoder_config, decoder_shapes, refuse


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2/V3). A token's cache row, per layer, is its
    normalized KV latent (kv_lora_rank) and its rotary key (rope_dim), shared by every head;
    kv_b_proj expands the latent into each head's non-rotary key (nope_dim) and value (v_dim)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    nope_dim: int  # qk_nope_head_dim
    rope_dim: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim
    # "pairs": the rotary dimensions rotate in adjacent pairs (x0, x1), (x2, x3), as DeepSeek's
    # weights are laid out (V2; V3's rope_interleave); "half": rotate-half, as Llama
    rope_pairs: bool = True

    @property
    def latent_dim(self) -> int:
        """Elements of one token's cache row per layer: latent, then rotary key."""
        return self.kv_lora_rank + self.rope_dim


def mla_of(config: ModelConfig) -> MlaShape:
    """The latent attention's shape of a config this family (or one built on it) read."""
    assert isinstance(config.shape, MlaShape), "not a latent-attention config"
    return config.shape


def read_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    _refuse_unimplemented(raw, model_type)
    mla = read_mla(raw)
    layers = int(raw["num_hidden_layers"])
    return decoder_config(
        raw,
        model_type,
        head_dim=mla.nope_dim + mla.rope_dim,
        moe=read_moe(raw, model_type),
        shape=mla,
        cache=latent_cache(layers, mla),
    )


def latent_cache(layers: int, mla: MlaShape) -> CacheSpec:
    """Every layer's latent and rotary key, one "head" of K, no V, kept for good."""
    return CacheSpec.uniform(layers, 1, mla.latent_dim, 0, name="latent")


def read_mla(raw: dict[str, Any], shape: type[MlaShape] | None = None, **more: Any) -> MlaShape:
    """The latent attention's fields (as `shape`, a subclass's, with `more` of its own)."""
    q_lora = raw.get("q_lora_rank")
    return (shape or MlaShape)(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        nope_dim=int(raw["qk_nope_head_dim"]),
        rope_dim=int(raw["qk_rope_head_dim"]),
        v_dim=int(raw["v_head_dim"]),
        # V2 rotates pairs always; V3 where rope_interleave (its default) says so
        rope_pairs=raw.get("model_type") == "deepseek_v2"
        or "rope_interleave" not in raw
        or bool(raw["rope_interleave"]),
        **more,
    )


def read_moe(raw: dict[str, Any], model_type: str, moe_layers: list[int] | None = None) -> MoeShape:
    """The experts as transformers builds them (`moe_layers`: which layers have them, where
    the config lists them; else from first_k_dense_replace and moe_layer_freq)."""
    layers = range(int(raw["num_hidden_layers"]))
    experts = int(raw.get("n_routed_experts") or 0)
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    freq = int(raw.get("moe_layer_freq") or 1)
    if moe_layers is None:
        moe_layers = [i for i in layers if experts and i >= first_dense and i % freq == 0]
    v3 = model_type != "deepseek_v2"
    return MoeShape(
        num_experts=experts,
        top_k=int(raw.get("num_experts_per_tok") or 1),
        intermediate_size=int(raw["moe_intermediate_size"]),
        layers=tuple(moe_layers),
        scoring=raw.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
        topk_method=raw.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        # transformers' DeepSeek-V2 router never renormalizes; V3's does where asked
        norm_topk_prob=v3 and bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        shared_intermediate_size=int(raw["moe_intermediate_size"])
        * int(raw.get("n_shared_experts") or 0),
        float32_router=True,
    )


def _refuse_unimplemented(raw: dict[str, Any], model_type: str) -> None:
    """A field value the engine does not implement stops the load, named: never mis-run."""
    v3 = model_type != "deepseek_v2"
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if scoring not in SCORING:
        refuse(raw, "scoring_func", f"the engine scores experts by {' or '.join(SCORING)}")
    if method not in TOPK_METHODS:
        refuse(raw, "topk_method", f"the engine implements {', '.join(TOPK_METHODS)}")
    if v3 and (method, scoring) != ("noaux_tc", "sigmoid"):
        refuse(raw, "topk_method", "DeepSeek-V3 routes by noaux_tc over sigmoid scores")
    if not v3 and method == "noaux_tc":
        refuse(raw, "topk_method", "DeepSeek-V2 routes greedily or group-limited, by softmax")
    if raw.get("n_routed_experts") and int(raw.get("n_group") or 1) > 1:
        experts, groups = int(raw["n_routed_experts"]), int(raw["n_group"])
        if experts % groups:
            refuse(raw, "n_group", f"{experts} experts do not split into {groups} groups")


def mla_shapes(c: ModelConfig, p: str) -> Shapes:
    mla, hidden, heads, bias = mla_of(c), c.hidden_size, c.num_heads, c.attention_bias
    qk = mla.nope_dim + mla.rope_dim
    shapes: Shapes = {
        p + "kv_a_proj_with_mqa.weight": (mla.latent_dim, hidden),
        p + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        p + "kv_b_proj.weight": (heads * (mla.nope_dim + mla.v_dim), mla.kv_lora_rank),
        p + "o_proj.weight": (hidden, heads * mla.v_dim),
    }
    if mla.q_lora_rank is None:
        shapes[p + "q_proj.weight"] = (heads * qk, hidden)
    else:
        shapes |= {
            p + "q_a_proj.weight": (mla.q_lora_rank, hidden),
            p + "q_a_layernorm.weight": (mla.q_lora_rank,),
            p + "q_b_proj.weight": (heads * qk, mla.q_lora_rank),
        }
    if bias:
        shapes[p + "kv_a_proj_with_mqa.bias"] = (mla.latent_dim,)
        shapes[p + "o_proj.bias"] = (hidden,)
        if mla.q_lora_rank is not None:
            shapes[p + "q_a_proj.bias"] = (mla.q_lora_rank,)
    return shapes


def expected_shapes(c: ModelConfig) -> Shapes:
    return decoder_shapes(c, mla_shapes)
