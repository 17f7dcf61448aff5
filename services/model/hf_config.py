"""Read a Hugging Face checkpoint directory's config.json (and generation_config.json's end
tokens) into a ModelConfig, without torch: the router reads it too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.model.config import ModelConfig, RopeScaling
from services.model.errors import ModelLoadError, read_json_object

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


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
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError("config.json", f"unsupported hidden_act {raw['hidden_act']!r}")
    if raw.get("mlp_bias"):
        raise ModelLoadError("config.json", "unsupported mlp_bias=true")
    heads = int(raw["num_attention_heads"])
    rope = dict(raw.get("rope_parameters") or {})
    # transformers 5 writes rope_parameters; older configs rope_theta and rope_scaling
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type") != "default" else None)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    window = raw.get("sliding_window")
    if arch == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        rope_scaling=_rope_scaling(scaling),
        sliding_window=int(window) if window else None,
        name=str(raw.get("_name_or_path") or arch),
    )


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise ModelLoadError("config.json", f"unsupported rope_scaling type {kind!r}")


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
