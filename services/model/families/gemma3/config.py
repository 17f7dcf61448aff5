"""Gemma 3's text decoder (`Gemma3ForCausalLM`, model_type gemma3_text) as transformers reads
its config.json: local (sliding-window) and global layers interleaved, each kind with its own
rope base (the global one scaled on larger models), q and k RMS-normed per head, norms before
and after each block with (1 + weight), embeddings scaled by sqrt(hidden), GELU (tanh)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from services.model.cache_spec import CacheSpec
from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.families.llama import refuse
from services.model.loading.hf_fields import eos_ids, rope_scaling
from services.model.loading.shapes import embedding_shapes
from services.model.vision.images import Preprocess, read_preprocess
from services.model.vision.shape import SiglipShape, VisionShape

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Gemma3Shape:
    windows: tuple[int | None, ...]  # per layer: the sliding window, None for a global layer
    local_theta: float  # rope base of the sliding layers (the global one is config.rope_theta,
    # scaled by config.rope_scaling)
    query_scale: float  # query_pre_attn_scalar ** -0.5
    # the logits' tanh cap; attn_logit_softcapping is not applied (transformers' Gemma 3
    # attention does not pass it on either)
    final_softcap: float | None


def gemma3_from_hf(raw: dict[str, Any], layers: int) -> Gemma3Shape:
    pattern = int(raw.get("sliding_window_pattern") or 6)
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    types = list(types)[:layers]
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad or len(types) != layers:
        raise ValueError(f"layer_types {bad or types} (one of {', '.join(LAYER_TYPES)} a layer)")
    window = int(raw.get("sliding_window") or 4096)
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    return Gemma3Shape(
        windows=tuple(window if t == "sliding_attention" else None for t in types),
        local_theta=float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0),
        query_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5,
        final_softcap=_optional(raw.get("final_logit_softcapping")),
    )


def global_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The global layers' rope parameters (theta, and scaling if any)."""
    params = (raw.get("rope_parameters") or {}).get("full_attention")
    if isinstance(params, dict):
        return params
    return {"rope_theta": raw.get("rope_theta") or 1000000.0, **(raw.get("rope_scaling") or {})}


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def gemma3_of(config: ModelConfig) -> Gemma3Shape:
    assert isinstance(config.shape, Gemma3Shape), "not a Gemma 3 config"
    return config.shape


def read_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    """GQA with q/k norms, local and global layers, GELU MLPs."""
    activation = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError("config.json", f"unsupported hidden_activation {activation!r}")
    if raw.get("mlp_bias"):
        raise ModelLoadError("config.json", "unsupported mlp_bias=true")
    if raw.get("use_bidirectional_attention"):
        refuse(
            raw, "use_bidirectional_attention", "a causal decoder attends to earlier tokens only"
        )
    layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
    rope = global_rope(raw)
    gemma = gemma3_from_hf(raw, layers)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or 256)
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or 1000000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_bias=bool(raw.get("attention_bias")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw),
        rope_scaling=rope_scaling(rope),
        qk_norm=True,
        shape=gemma,
        cache=CacheSpec.by_layer(kv_heads, head_dim, gemma.windows),
        name=str(raw.get("_name_or_path") or "gemma3"),
    )


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv, d = c.hidden_size, c.q_size, c.kv_size, c.head_dim
    shapes = embedding_shapes(c.vocab_size, c.hidden_size, c.tie_word_embeddings)
    for i in range(c.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[f"{p}{norm}_layernorm.weight"] = (h,)
        shapes |= {
            a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h),
            a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q),
            a + "q_norm.weight": (d,), a + "k_norm.weight": (d,),
            m + "gate_proj.weight": (c.intermediate_size, h),
            m + "up_proj.weight": (c.intermediate_size, h),
            m + "down_proj.weight": (h, c.intermediate_size),
        }  # fmt: skip
        if c.attention_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                       a + "o_proj.bias": (h,)}  # fmt: skip
    return shapes


def read_vision_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    """`Gemma3ForConditionalGeneration`: the text decoder above (text_config) and its SigLIP
    tower, whose 4096 patches (896 / 14 per side) are average-pooled to `mm_tokens_per_image`
    rows, RMS-normed and projected to the text width; an image's rows attend to each other
    both ways. The processor's settings come from preprocessor_config.json (`_preprocessor`,
    merged in by hf_config)."""
    text = dict(raw["text_config"])
    for key in ("eos_token_id", "_name_or_path"):
        if key in raw:
            text[key] = raw[key]
    config = read_config(text, "gemma3_text")
    v = raw["vision_config"]
    if v.get("vision_use_head"):
        raise ModelLoadError("config.json", "vision_config.vision_use_head=true is not served")
    if v.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError("config.json", f"unsupported vision hidden_act {v['hidden_act']!r}")
    tower = SiglipShape(
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_layers=int(v["num_hidden_layers"]),
        num_heads=int(v["num_attention_heads"]),
        image_size=int(v["image_size"]),
        patch_size=int(v["patch_size"]),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
    )
    tokens = int(raw.get("mm_tokens_per_image") or 256)
    side = round(tokens**0.5)
    if side * side != tokens or tower.patches_per_side % side:
        raise ModelLoadError(
            "config.json",
            f"mm_tokens_per_image {tokens}: a square whose side divides the "
            f"{tower.patches_per_side} patches per side",
        )
    projector = {
        "multi_modal_projector.mm_input_projection_weight": (tower.hidden_size, config.hidden_size),
        "multi_modal_projector.mm_soft_emb_norm.weight": (tower.hidden_size,),
    }
    square = Preprocess(tower.image_size, tower.image_size, (0.5,) * 3, (0.5,) * 3)
    vision = VisionShape(
        image_token_id=int(raw.get("image_token_index") or raw["image_token_id"]),
        tokens_per_image=tokens,
        begin_token_id=int(raw.get("boi_token_index") or 255999),
        end_token_id=int(raw.get("eoi_token_index") or 256000),
        around="\n\n",
        preprocess=read_preprocess(raw.get("_preprocessor") or {}, square),
        tower=tower,
        encoder="services.model.families.gemma3.vision:Gemma3Encoder",
        weights=("vision_tower.", "multi_modal_projector."),
        tensors=tuple((tower.tensor_shapes("vision_tower.") | projector).items()),
        renames=RENAMES,
        bidirectional=True,
    )
    return dataclasses.replace(config, architecture=model_type, vision=vision)


# checkpoint names as transformers 4 and 5 save them -> the names the model reads
RENAMES = (
    (r"^(model\.)?language_model\.(model\.)?", "model."),
    (r"^model\.lm_head\.", "lm_head."),
    (r"^(model\.)?vision_tower\.(vision_model\.)?", "vision_tower."),
    (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
)
