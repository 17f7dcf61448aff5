"""The model families served, one place each (family.py says what a family declares), and the
lookups the rest of the code makes instead of asking which family a config is.

Adding a family: its place under this folder, and its line in FAMILIES.
"""

from __future__ import annotations

import math
from typing import Any

from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.families import (
    deepseek,
    deepseek_v4,
    deepseek_v32,
    gemma3,
    gpt_oss,
    llama,
    mixtral,
    qwen_moe,
)
from services.model.families.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mixtral.FAMILY,
    qwen_moe.FAMILY,
    deepseek.FAMILY,
    deepseek_v32.FAMILY,
    deepseek_v4.FAMILY,
    gpt_oss.FAMILY,
    gemma3.FAMILY,
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_CLASS = {a: (f, t) for f in FAMILIES for a, t in f.architectures.items()}
ARCHITECTURES = tuple(_BY_CLASS)  # the Hugging Face architecture names served
MODEL_TYPES = tuple(_BY_TYPE)


def of(config: ModelConfig) -> Family:
    """The family that read `config`."""
    return _BY_TYPE[config.architecture]


def read_config(raw: dict[str, Any]) -> ModelConfig:
    """A config.json read by the family serving its architecture; ModelLoadError naming the
    architecture (or a field) the engine does not serve."""
    archs = raw.get("architectures") or []
    found = next((_BY_CLASS[a] for a in archs if a in _BY_CLASS), None)
    if not archs and raw.get("model_type") in _BY_TYPE:
        found = (_BY_TYPE[raw["model_type"]], raw["model_type"])
    if found is None:
        supported = ", ".join(ARCHITECTURES)
        raise ModelLoadError(
            "config.json", f"unsupported architecture {archs} (supported: {supported})"
        )
    family, model_type = found
    return family.read_config(raw, model_type)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config calls for and the shape it must have."""
    return of(config).expected_shapes(config)


def num_parameters(config: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in expected_shapes(config).values())
