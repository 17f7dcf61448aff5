"""config.json -> ModelConfig for the window-and-sink families: DeepSeek-V4, gpt-oss,
Gemma 3 (their own shapes: v4_config.py, oss_config.py, gemma3_config.py). No torch."""

from __future__ import annotations

from typing import Any

from services.model.config import ModelConfig, MoeShape
from services.model.gemma3_config import gemma3_from_hf, global_rope
from services.model.hf_fields import eos_ids, fp8_block, rope_scaling
from services.model.oss_config import oss_from_hf
from services.model.v4_config import SCORING as V4_SCORING
from services.model.v4_config import main_rope_theta, v4_from_hf


def deepseek_v4(raw: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V4: one shared K=V head, experts in every layer (v4_config.py has the rest)."""
    layers, head_dim = int(raw["num_hidden_layers"]), int(raw.get("head_dim") or 512)
    v4 = v4_from_hf(raw, head_dim, layers)
    ff = int(raw["moe_intermediate_size"])
    quantization = dict(raw.get("quantization_config") or {})
    return ModelConfig(
        architecture="deepseek_v4",
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
        v4=v4,
        fp8_block=fp8_block(quantization and {"weight_block_size": [128, 128]} | quantization),
        name=str(raw.get("_name_or_path") or "deepseek_v4"),
    )


def gpt_oss(raw: dict[str, Any]) -> ModelConfig:
    """gpt-oss: GQA with biases and sinks, sliding and full layers, experts in every layer."""
    layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    ff = int(raw["intermediate_size"])
    return ModelConfig(
        architecture="gpt_oss",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=ff,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
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
        oss=oss_from_hf(raw, layers),
        name=str(raw.get("_name_or_path") or "gpt_oss"),
    )


def gemma3(raw: dict[str, Any]) -> ModelConfig:
    """Gemma 3 (text): GQA with q/k norms, local and global layers, GELU MLPs."""
    layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
    rope = global_rope(raw)
    return ModelConfig(
        architecture="gemma3_text",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or 256),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or 1000000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_bias=bool(raw.get("attention_bias")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw),
        rope_scaling=rope_scaling(rope),
        qk_norm=True,
        gemma3=gemma3_from_hf(raw, layers),
        name=str(raw.get("_name_or_path") or "gemma3"),
    )


def refuse_v4(raw: dict[str, Any], refuse: Any) -> None:
    if int(raw.get("num_key_value_heads") or 1) != 1:
        refuse("num_key_value_heads", "DeepSeek-V4 has one shared K=V head")
    if raw.get("attention_bias"):
        refuse("attention_bias", "DeepSeek-V4's projections have no bias")
    if (raw.get("scoring_func") or "sqrtsoftplus") not in V4_SCORING:
        refuse("scoring_func", f"DeepSeek-V4 experts are scored by {' or '.join(V4_SCORING)}")
    quantization = raw.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "fp8":
        refuse("quantization_config", "DeepSeek-V4 checkpoints come in fp8 (with fp4 experts)")
    if quantization.get("scale_fmt", "ue8m0") not in ("ue8m0", "float"):
        refuse("quantization_config", "scales are ue8m0 or float")
    experts = quantization.get("expert_dtype") or raw.get("expert_dtype")
    if experts not in (None, "fp8", "fp4"):
        refuse("expert_dtype", "DeepSeek-V4's experts are fp8 or fp4")
    heads, groups = int(raw["num_attention_heads"]), int(raw.get("o_groups") or 8)
    if heads % groups:
        refuse("o_groups", f"{heads} heads do not split into {groups} groups")
    main = (raw.get("rope_parameters") or {}).get("main")
    if isinstance(main, dict) and main.get("rope_type", "default") != "default":
        refuse("rope_parameters", "the main rope set (sliding layers) is unscaled in DeepSeek-V4")
