"""DeepSeek-V4's shape, read from a config.json as transformers reads it
(`DeepseekV4Config`), its tensor names and shapes, and what a token's cache row holds.

Every layer attends over a sliding window of one shared K=V head (with a learned sink per
head); a compressed-sparse layer (CSA) adds one compressed entry per `csa_rate` tokens, of
which a lightning indexer picks the top `index_topk` for each query; a heavily compressed layer
(HCA) adds one entry per `hca_rate` tokens, all visible. docs/deepseek-v4.md has the whole
arithmetic, docs/structures.md the cache layout this module's `row_layout` describes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvstore.block_hash import BLOCK_SIZE
from services.model.cache_spec import CacheGroup, CacheSpec
from services.model.config import ModelConfig, MoeShape
from services.model.families.llama import check_swiglu, refuse
from services.model.loading.hf_fields import eos_ids, fp8_block

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # legacy `compress_ratios`
MLP_TYPES = ("hash_moe", "moe")
SHARES, WINDOW_PART = "v4 shares", "v4 window"  # the cache groups (cache_spec)
SCORING = ("sqrtsoftplus", "sigmoid")


@dataclass(frozen=True)
class V4Shape:
    """What DeepSeek-V4 adds to a decoder's shape (ModelConfig.head_dim is its K=V head's
    512, num_heads its query heads; the main rope set is ModelConfig's rope_theta)."""

    layer_types: tuple[str, ...]  # LAYER_TYPES, per layer
    csa_rate: int  # tokens per compressed entry, CSA layers (4)
    hca_rate: int  # HCA layers (128)
    window: int  # sliding_window: a query sees itself and the window - 1 tokens before it
    q_lora_rank: int
    rope_dim: int  # the last rope_dim of a head rotate, in adjacent pairs
    compress_rope_theta: float  # CSA and HCA layers' rope set
    compress_yarn: dict[str, float] | None  # its YaRN, if any (cos/sin unscaled)
    o_groups: int  # grouped output projection: heads in o_groups groups ...
    o_lora_rank: int  # ... each projected to this width
    index_heads: int
    index_dim: int
    index_topk: int
    hc_mult: int  # residual streams (hyper-connections)
    hc_iters: int  # Sinkhorn iterations
    hc_eps: float
    hash_layers: tuple[int, ...]  # layers whose experts come from tid2eid[token]
    swiglu_limit: float  # experts' gate clamped above, up clamped both ways
    scoring: str  # SCORING
    fp4_experts: bool = False  # routed experts stored as FP4 (quant.py)

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry in `layer` (0: a sliding-only layer)."""
        kind = self.layer_types[layer]
        return self.csa_rate if kind == CSA else self.hca_rate if kind == HCA else 0


@dataclass(frozen=True)
class LayerRow:
    """One layer's part of a token's cache row, in elements. A token's row is two rows in two
    pools (config.cache_shape, KVCache): its window part, read while the token is among the
    last `window_keep` tokens and then released, and its shares, kept for good:

        window row, at `offset`:  | kv (window key = value) | raw (the compressor's inputs) |
        share row, at `share_at`: | share (of an entry) |

    raw holds what compression reads: kv_proj and gate_proj of the token (gate without the
    position bias), for CSA also the indexer's two. share: compressed entry e (its key, then
    for CSA its indexer key) is cut into `span` pieces, kept by the `span` tokens that end at
    the token closing it ((e + 1) * rate - 1): they lie in that token's block, so a block's
    bytes depend on its prefix only, like any block's."""

    offset: int
    kv: int
    raw: int
    share_at: int
    share: int
    span: int  # tokens sharing one entry: gcd(rate, block size); 0 without a compressor
    entry: int  # elements of one entry (key, plus the indexer key for CSA)

    @property
    def width(self) -> int:
        return self.kv + self.raw + self.share


def row_layout(shape: V4Shape, head_dim: int) -> tuple[LayerRow, ...]:
    """Every layer's part of a token's two rows (each part even-sized: the bfloat16 cache holds
    elements in pairs)."""
    rows: list[LayerRow] = []
    offset = share_at = 0
    for layer, kind in enumerate(shape.layer_types):
        rate = shape.rate(layer)
        raw = entry = span = 0
        if kind == HCA:
            raw, entry = 2 * head_dim, head_dim
        elif kind == CSA:
            raw = 4 * head_dim + 4 * shape.index_dim
            entry = head_dim + shape.index_dim
        if rate:
            span = math.gcd(rate, BLOCK_SIZE)
        share = _even(-(-entry // span)) if span else 0
        row = LayerRow(offset, _even(head_dim), raw, share_at, share, span, entry)
        rows.append(row)
        offset += row.kv + row.raw
        share_at += row.share
    return tuple(rows)


def row_widths(shape: V4Shape, head_dim: int) -> tuple[int, int]:
    """Elements of a token's share row and of its window row."""
    rows = row_layout(shape, head_dim)
    return sum(r.share for r in rows), sum(r.kv + r.raw for r in rows)


def window_keep(shape: V4Shape) -> int:
    """How far back from its first new token a forward pass reads window rows: a query's
    window (window - 1 tokens before it), an open HCA window (rate - 1), a CSA entry's two
    windows (2 rate - 1). Rows further back are never read again."""
    reach = [shape.window - 1]
    reach += [
        2 * shape.rate(i) - 1 if kind == CSA else shape.rate(i) - 1
        for i, kind in enumerate(shape.layer_types)
        if kind != SLIDING
    ]
    return max(reach)


def _even(n: int) -> int:
    return n + n % 2


def v4_from_hf(raw: dict[str, Any], head_dim: int, layers: int) -> V4Shape:
    """The V4 fields of a config.json, legacy spellings folded in as transformers does."""
    rates = dict(raw.get("compress_rates") or {})
    csa = int(raw.get("compress_rate_csa") or rates.get(CSA, 4))
    hca = int(raw.get("compress_rate_hca") or rates.get(HCA, 128))
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        types = [RATIO_TO_TYPE.get(int(r), str(r)) for r in raw["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then HCA / CSA alternating
        types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(layers - 2)]
    mlp = raw.get("mlp_layer_types")
    if mlp is None:
        n_hash = int(raw.get("num_hash_layers", 3))
        mlp = ["hash_moe"] * min(layers, n_hash) + ["moe"] * max(0, layers - n_hash)
    types, mlp = list(types)[:layers], list(mlp)[:layers]
    _check_names("layer_types", types, LAYER_TYPES, layers)
    _check_names("mlp_layer_types", mlp, MLP_TYPES, layers)
    rope_dim = _rope_dim(raw, head_dim)
    _, compress = _rope_sets(raw)
    return V4Shape(
        layer_types=tuple(types),
        csa_rate=csa,
        hca_rate=hca,
        window=int(raw.get("sliding_window") or 128),
        q_lora_rank=int(raw.get("q_lora_rank") or 1024),
        rope_dim=rope_dim,
        compress_rope_theta=float(compress["rope_theta"]),
        compress_yarn=_yarn(compress),
        o_groups=int(raw.get("o_groups") or 8),
        o_lora_rank=int(raw.get("o_lora_rank") or 1024),
        index_heads=int(raw.get("index_n_heads") or 64),
        index_dim=int(raw.get("index_head_dim") or 128),
        index_topk=int(raw.get("index_topk") or 512),
        hc_mult=int(raw.get("hc_mult") or 4),
        hc_iters=int(raw.get("hc_sinkhorn_iters") or 20),
        hc_eps=float(raw.get("hc_eps") or 1e-6),
        hash_layers=tuple(i for i, t in enumerate(mlp) if t == "hash_moe"),
        swiglu_limit=float(raw.get("swiglu_limit") or 0.0),
        scoring=str(raw.get("scoring_func") or "sqrtsoftplus"),
        fp4_experts=(
            (raw.get("quantization_config") or {}).get("expert_dtype") or raw.get("expert_dtype")
        )
        == "fp4",
    )


def mtp_layer_type(raw: dict[str, Any], layers: int) -> str:
    """The attention of the MTP layer after the `layers` decoder layers: DeepSeek's config
    lists it as entry `layers` of `compress_ratios` (or `layer_types`); sliding if absent."""
    types = raw.get("layer_types") or []
    if len(types) > layers:
        kind = str(types[layers])
    else:
        ratios = raw.get("compress_ratios") or []
        kind = RATIO_TO_TYPE.get(int(ratios[layers]), "") if len(ratios) > layers else SLIDING
    if kind not in LAYER_TYPES:
        raise ValueError(f"the MTP layer's attention {kind!r} (of {', '.join(LAYER_TYPES)})")
    return kind


def main_rope_theta(raw: dict[str, Any]) -> float:
    main, _ = _rope_sets(raw)
    return float(main.get("rope_theta") or raw.get("rope_theta") or 10000.0)


def _rope_dim(raw: dict[str, Any], head_dim: int) -> int:
    if raw.get("qk_rope_head_dim"):
        return int(raw["qk_rope_head_dim"])
    factor = raw.get("partial_rotary_factor")
    return int(head_dim * float(factor)) if factor else head_dim // 8


def _rope_sets(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """transformers 5 nests `rope_parameters` as {"main": ..., "compress": ...}; older configs
    give rope_theta, compress_rope_theta and a flat rope_scaling for the compress set."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        compress = dict(params["compress"])
        compress.setdefault("rope_theta", raw.get("compress_rope_theta") or 160000.0)
        return params["main"], compress
    flat = dict(raw.get("rope_scaling") or params)
    flat["rope_theta"] = raw.get("compress_rope_theta") or 160000.0
    return {"rope_theta": raw.get("rope_theta") or 10000.0}, flat


def _yarn(compress: dict[str, Any]) -> dict[str, float] | None:
    kind = compress.get("rope_type") or compress.get("type") or "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"compress rope_type {kind!r} (default or yarn)")
    return {
        "factor": float(compress["factor"]),
        "original_max_position_embeddings": float(compress["original_max_position_embeddings"]),
        "beta_fast": float(compress.get("beta_fast") or 32.0),
        "beta_slow": float(compress.get("beta_slow") or 1.0),
    }


def _check_names(field: str, got: list[Any], allowed: tuple[str, ...], layers: int) -> None:
    if len(got) != layers:
        raise ValueError(f"{field} has {len(got)} entries for {layers} layers")
    bad = sorted({str(t) for t in got if t not in allowed})
    if bad:
        raise ValueError(f"{field} entries {bad} (choose from {', '.join(allowed)})")


def v4_of(config: ModelConfig) -> V4Shape:
    assert isinstance(config.shape, V4Shape), "not a DeepSeek-V4 config"
    return config.shape


def cache_spec(shape: V4Shape, head_dim: int) -> CacheSpec:
    """One cache layer holding every layer's part of a token's row: its shares (kept), then
    its window part (released once out of every window: `window_keep`)."""
    shares, window = row_widths(shape, head_dim)
    groups = (
        CacheGroup(SHARES, (0,), (0, shares), (0, 0)),
        CacheGroup(WINDOW_PART, (0,), (shares, shares + window), (0, 0), window_keep(shape)),
    )
    return CacheSpec(1, 1, shares + window, 0, groups, row_layout="v4: shares, then window part")


def read_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    """DeepSeek-V4: one shared K=V head, experts in every layer."""
    _refuse_unimplemented(raw)
    check_swiglu(raw)
    layers, head_dim = int(raw["num_hidden_layers"]), int(raw.get("head_dim") or 512)
    v4 = v4_from_hf(raw, head_dim, layers)
    ff = int(raw["moe_intermediate_size"])
    quantization = dict(raw.get("quantization_config") or {})
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=ff,
        num_layers=layers,
        num_heads=int(raw["num_attention_heads"]),
        num_kv_heads=1,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=main_rope_theta(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=False,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw),
        moe=MoeShape(
            num_experts=int(raw["n_routed_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=ff,
            layers=tuple(range(layers)),
            scoring=v4.scoring,
            topk_method="noaux_tc",
            norm_topk_prob=True,  # V4 always renormalizes
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            shared_intermediate_size=ff,  # transformers builds one shared expert, whatever n
        ),
        shape=v4,
        cache=cache_spec(v4, head_dim),
        fp8_block=fp8_block(quantization and {"weight_block_size": [128, 128]} | quantization),
        name=str(raw.get("_name_or_path") or model_type),
    )


def _refuse_unimplemented(raw: dict[str, Any]) -> None:
    if int(raw.get("num_key_value_heads") or 1) != 1:
        refuse(raw, "num_key_value_heads", "DeepSeek-V4 has one shared K=V head")
    if raw.get("attention_bias"):
        refuse(raw, "attention_bias", "DeepSeek-V4's projections have no bias")
    if (raw.get("scoring_func") or "sqrtsoftplus") not in SCORING:
        refuse(raw, "scoring_func", f"DeepSeek-V4 experts are scored by {' or '.join(SCORING)}")
    quantization = raw.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "fp8":
        refuse(raw, "quantization_config", "DeepSeek-V4 checkpoints come in fp8 (with fp4 experts)")
    if quantization.get("scale_fmt", "ue8m0") not in ("ue8m0", "float"):
        refuse(raw, "quantization_config", "scales are ue8m0 or float")
    experts = quantization.get("expert_dtype") or raw.get("expert_dtype")
    if experts not in (None, "fp8", "fp4"):
        refuse(raw, "expert_dtype", "DeepSeek-V4's experts are fp8 or fp4")
    heads, groups = int(raw["num_attention_heads"]), int(raw.get("o_groups") or 8)
    if heads % groups:
        refuse(raw, "o_groups", f"{heads} heads do not split into {groups} groups")
    main = (raw.get("rope_parameters") or {}).get("main")
    if isinstance(main, dict) and main.get("rope_type", "default") != "default":
        refuse(
            raw, "rope_parameters", "the main rope set (sliding layers) is unscaled in DeepSeek-V4"
        )
