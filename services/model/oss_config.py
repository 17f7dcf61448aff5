"""gpt-oss's shape (`GptOssForCausalLM`, as transformers reads its config.json) and tensor
names: sliding-window and full attention layers alternating, a learned sink per head in every
layer, biases on every projection, and experts in every layer (router with a bias, softmax over
the chosen top-k, SwiGLU clamped with an `(up + 1) * gate * sigmoid(alpha * gate)` form)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.model.shapes import embedding_shapes

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


def expected_shapes(c: Any) -> dict[str, tuple[int, ...]]:
    # c: a ModelConfig (config.py imports this module, so it is not imported here)
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
