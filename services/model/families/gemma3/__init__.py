"""Gemma 3: its text decoder (local sliding-window and global layers, each kind with its own
rope base, q/k norms, GELU MLPs, norms before and after each block: config.py, model.py) and,
in `Gemma3ForConditionalGeneration`, its SigLIP vision tower and projector (vision.py)."""

from __future__ import annotations

from typing import Any

from services.model.config import ModelConfig
from services.model.families.family import Family
from services.model.families.gemma3.config import expected_shapes, read_config, read_vision_config


def _read(raw: dict[str, Any], model_type: str) -> ModelConfig:
    reader = read_vision_config if model_type == "gemma3" else read_config
    return reader(raw, model_type)


FAMILY = Family(
    name="gemma3",
    architectures={"Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3"},
    read_config=_read,
    expected_shapes=expected_shapes,
    model="services.model.families.gemma3.model:Gemma3Model",
)
