"""gpt-oss's shape (`GptOssForCausalLM`, as transformers reads its config.json) and tensor
names: sliding-window and full attention layers alternating, a learned sink per head in every
layer, biases on every projection, and experts in every layer (router with a bias, softmax over
the chosen top-k, SwiGLU clamped with an `(up + 1) * gate * sigmoid(alpha * gate)` form)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.model.cache_spec import CacheSpec
from services.model.config import ModelConfig, MoeShape
from services.model.families.llama import check_swiglu, refuse
from services.model.loading.hf_fields import eos_ids, rope_scaling
from services.model.loading.shapes import embedding_shapes

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class OssShape:
    windows: tuple[int | None, ...]  # per layer: the sliding window, None for full attention
    swiglu_limit: float
    swiglu_alpha: float


def oss_from_hf(raw: dict[str, Any], layers: int) -> OssShape:
    window = int(raw.get("sliding_window") or 128)
    types = raw.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(layers)]
    types = list(types)[:layers]
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad or len(types) != layers:
        raise ValueError(f"layer_types {bad or types} (one of {', '.join(LAYER_TYPES)} a layer)")
    return OssShape(
        windows=tuple(window if t == "sliding_attention" else None for t in types),
        swiglu_limit=float(raw.get("swiglu_limit") or 7.0),
        swiglu_alpha=float(raw.get("swiglu_alpha") or 1.702),
    )


def oss_of(config: ModelConfig) -> OssShape:
    assert isinstance(config.shape, OssShape), "not a gpt-oss config"
    return config.shape


def read_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    """GQA with biases and sinks, sliding and full layers, experts in every layer."""
    if raw.get("quantization_config"):
        refuse(raw, "quantization_config", "gpt-oss's MXFP4 experts are not read yet")
    check_swiglu(raw)
    layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    ff = int(raw["intermediate_size"])
    oss = oss_from_hf(raw, layers)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=ff,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or 150000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw),
        rope_scaling=rope_scaling(rope or None),
        moe=MoeShape(
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=ff,
            layers=tuple(range(layers)),
            norm_topk_prob=True,  # softmax over the chosen experts' logits
        ),
        shape=oss,
        cache=CacheSpec.by_layer(kv_heads, head_dim, oss.windows),
        name=str(raw.get("_name_or_path") or model_type),
    )


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    moe = c.moe
    assert moe is not None
    h, q, kv, e, ff = c.hidden_size, c.q_size, c.kv_size, moe.num_experts, moe.intermediate_size
    shapes = embedding_shapes(c.vocab_size, c.hidden_size, c.tie_word_embeddings)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            a + "q_proj.weight": (q, h), a + "q_proj.bias": (q,),
            a + "k_proj.weight": (kv, h), a + "k_proj.bias": (kv,),
            a + "v_proj.weight": (kv, h), a + "v_proj.bias": (kv,),
            a + "o_proj.weight": (h, q), a + "o_proj.bias": (h,),
            a + "sinks": (c.num_heads,),
            m + "router.weight": (e, h), m + "router.bias": (e,),
            m + "experts.gate_up_proj": (e, h, 2 * ff),
            m + "experts.gate_up_proj_bias": (e, 2 * ff),
            m + "experts.down_proj": (e, ff, h), m + "experts.down_proj_bias": (e, h),
        }  # fmt: skip
    return shapes
