"""Read a Hugging Face checkpoint directory's config.json (and generation_config.json's end
tokens) into a ModelConfig, without torch: the router reads it too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.model import families
from services.model.config import ModelConfig
from services.model.errors import ModelLoadError, read_json_object


def read_config(path: Path) -> ModelConfig:
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(path, "no config.json in the model directory")
    raw = read_json_object(file) | _generation_eos(path)
    processor = path / "preprocessor_config.json"  # a model that reads images: its pixels
    if processor.is_file():
        raw["_preprocessor"] = read_json_object(processor)
    try:
        return config_from_hf(raw)
    except ModelLoadError as e:
        raise ModelLoadError(file, e.problem) from None
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(file, f"missing or malformed field: {e}") from e


def mtp_layers(path: Path) -> int:
    """How many multi-token-prediction layers the checkpoint's config declares (0: none; a
    family's MTP module serves the first)."""
    return int(read_json_object(path / "config.json").get("num_nextn_predict_layers") or 0)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """config.json's fields read by the family serving its architecture (families/)."""
    return families.read_config(raw)


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
