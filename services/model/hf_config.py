"""Read a Hugging Face checkpoint directory's config.json (and generation_config.json's end
tokens) into a ModelConfig, without torch: the router reads it too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.model import hf_families
from services.model.config import (
    SCORING,
    TOPK_METHODS,
    MlaShape,
    ModelConfig,
    MoeShape,
)
from services.model.errors import ModelLoadError, read_json_object
from services.model.hf_fields import eos_ids, fp8_block, rope_scaling

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma3ForCausalLM": "gemma3_text",
}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")


def read_config(path: Path) -> ModelConfig:
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(path, "no config.json in the model directory")
    raw = read_json_object(file) | _generation_eos(path)
    try:
        return config_from_hf(raw)
    except ModelLoadError as e:
        raise ModelLoadError(file, e.problem) from None
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(file, f"missing or malformed field: {e}") from e


def mtp_layers(path: Path) -> int:
    """How many multi-token-prediction layers the checkpoint's config declares (0: none;
    services/model/mtp.py serves the first)."""
    return int(read_json_object(path / "config.json").get("num_nextn_predict_layers") or 0)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if not archs and raw.get("model_type") in HF_ARCHITECTURES.values():
        arch = raw["model_type"]
    if arch is None:
        supported = ", ".join(HF_ARCHITECTURES)
        raise ModelLoadError(
            "config.json", f"unsupported architecture {archs} (supported: {supported})"
        )
    if arch == "gemma3_text" and raw.get("hidden_activation", "gelu_pytorch_tanh") not in (
        "gelu_pytorch_tanh",
        "gelu_tanh",
    ):
        raise ModelLoadError(
            "config.json", f"unsupported hidden_activation {raw['hidden_activation']!r}"
        )
    if arch != "gemma3_text" and raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError("config.json", f"unsupported hidden_act {raw['hidden_act']!r}")
    if raw.get("mlp_bias"):
        raise ModelLoadError("config.json", "unsupported mlp_bias=true")
    _refuse_unimplemented(arch, raw)
    if arch == "deepseek_v4":
        return hf_families.deepseek_v4(raw)
    if arch == "gpt_oss":
        return hf_families.gpt_oss(raw)
    if arch == "gemma3_text":
        return hf_families.gemma3(raw)
    heads = int(raw["num_attention_heads"])
    rope = dict(raw.get("rope_parameters") or {})
    # transformers 5 writes rope_parameters; older configs rope_theta and rope_scaling
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type") != "default" else None)
    window = raw.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not raw.get("use_sliding_window"):
        window = None
    mla = _mla(raw) if arch in DEEPSEEK else None
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=mla.nope_dim + mla.rope_dim if mla else head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(
            raw.get("qkv_bias", True)
            if arch in ("qwen2", "qwen2_moe")
            else raw.get("attention_bias")
        ),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw),
        rope_scaling=rope_scaling(scaling),
        sliding_window=int(window) if window else None,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        mla=mla,
        moe=_moe(arch, raw),
        fp8_block=fp8_block(raw.get("quantization_config")),
        name=str(raw.get("_name_or_path") or arch),
    )


def _mla(raw: dict[str, Any]) -> MlaShape:
    q_lora = raw.get("q_lora_rank")
    return MlaShape(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        nope_dim=int(raw["qk_nope_head_dim"]),
        rope_dim=int(raw["qk_rope_head_dim"]),
        v_dim=int(raw["v_head_dim"]),
        # V2 rotates pairs always; V3 where rope_interleave (its default) says so
        rope_pairs=raw.get("model_type") == "deepseek_v2"
        or "rope_interleave" not in raw
        or bool(raw["rope_interleave"]),
    )


def _moe(arch: str, raw: dict[str, Any]) -> MoeShape | None:
    """The MoE layers of each family, as transformers builds them."""
    layers = range(int(raw["num_hidden_layers"]))
    if arch == "mixtral":
        return MoeShape(
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            layers=tuple(layers),
            norm_topk_prob=True,
            prefix="block_sparse_moe",
        )
    if arch in ("qwen2_moe", "qwen3_moe"):
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        moe = [i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0]
        shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0
        return MoeShape(
            num_experts=experts,
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            layers=tuple(moe),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_intermediate_size=shared,
            shared_gate=shared > 0,
        )
    if arch in DEEPSEEK:
        experts = int(raw.get("n_routed_experts") or 0)
        first_dense = int(raw.get("first_k_dense_replace") or 0)
        freq = int(raw.get("moe_layer_freq") or 1)
        moe = [i for i in layers if experts and i >= first_dense and i % freq == 0]
        v3 = arch == "deepseek_v3"
        return MoeShape(
            num_experts=experts,
            top_k=int(raw.get("num_experts_per_tok") or 1),
            intermediate_size=int(raw["moe_intermediate_size"]),
            layers=tuple(moe),
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
    return None


def _refuse_unimplemented(arch: str, raw: dict[str, Any]) -> None:
    """A field value the engine does not implement stops the load, named: never mis-run."""

    def refuse(field: str, why: str) -> None:
        raise ModelLoadError("config.json", f"unsupported {field}={raw.get(field)!r}: {why}")

    if arch in DEEPSEEK:
        v3 = arch == "deepseek_v3"
        scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if scoring not in SCORING:
            refuse("scoring_func", f"the engine scores experts by {' or '.join(SCORING)}")
        if method not in TOPK_METHODS:
            refuse("topk_method", f"the engine implements {', '.join(TOPK_METHODS)}")
        if v3 and (method, scoring) != ("noaux_tc", "sigmoid"):
            refuse("topk_method", "DeepSeek-V3 routes by noaux_tc over sigmoid scores")
        if not v3 and method == "noaux_tc":
            refuse("topk_method", "DeepSeek-V2 routes greedily or group-limited, by softmax")
        if raw.get("n_routed_experts") and int(raw.get("n_group") or 1) > 1:
            experts, groups = int(raw["n_routed_experts"]), int(raw["n_group"])
            if experts % groups:
                refuse("n_group", f"{experts} experts do not split into {groups} groups")
    if arch == "deepseek_v4":
        hf_families.refuse_v4(raw, refuse)
    if arch == "gemma3_text" and raw.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", "a causal decoder attends to earlier tokens only")
    if arch == "gpt_oss" and raw.get("quantization_config"):
        refuse("quantization_config", "gpt-oss's MXFP4 experts are not read yet")
    if arch == "mixtral" and raw.get("router_jitter_noise"):
        refuse("router_jitter_noise", "noise is for training")
    if arch in ("qwen3", "qwen2_moe", "qwen3_moe") and raw.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window layers are served for Mistral only")


def _generation_eos(path: Path) -> dict[str, Any]:
    """generation_config.json's eos ids win: chat models list their end-of-turn token there."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return {}
    return {} if eos is None else {"eos_token_id": eos}
