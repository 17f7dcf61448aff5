"""The model families served, one place each (family.py says what a family declares), and the
lookups the rest of the code makes instead of asking which family a config is.

Adding a family: its place under this folder, and its line in FAMILIES. A vision-language
checkpoint whose text part is another family's decoder (DeepSeek-VL) is read as that family's
config with its vision attached (ModelConfig.vision): its line is in WRAPPERS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.families import (
    deepseek,
    deepseek_v4,
    deepseek_v32,
    deepseek_vl,
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

# architecture -> (model_type, its reader: (config.json, the reader of its text_config))
Reader = Callable[[dict[str, Any]], ModelConfig]
WRAPPERS: dict[str, tuple[str, Callable[[dict[str, Any], Reader], ModelConfig]]] = {
    "DeepseekVLForConditionalGeneration": ("deepseek_vl", deepseek_vl.read_config),
}

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_CLASS = {a: (f, t) for f in FAMILIES for a, t in f.architectures.items()}
_WRAPPED = {t: read for t, read in WRAPPERS.values()}
ARCHITECTURES = (*_BY_CLASS, *WRAPPERS)  # the Hugging Face architecture names served
MODEL_TYPES = (*_BY_TYPE, *_WRAPPED)


def of(config: ModelConfig) -> Family:
    """The family that read `config`."""
    return _BY_TYPE[config.architecture]


def read_config(raw: dict[str, Any]) -> ModelConfig:
    """A config.json read by the family serving its architecture; ModelLoadError naming the
    architecture (or a field) the engine does not serve."""
    archs = raw.get("architectures") or []
    wrapper = next((WRAPPERS[a][1] for a in archs if a in WRAPPERS), None)
    if wrapper is None and not archs:
        wrapper = _WRAPPED.get(raw.get("model_type"))  # type: ignore[arg-type]
    if wrapper is not None:
        return wrapper(raw, read_config)
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
    """Every tensor the config calls for (its vision encoder's too) and the shape it must
    have, by name as `stored_name` gives it."""
    shapes = of(config).expected_shapes(config)
    return shapes if config.vision is None else shapes | config.vision.tensor_shapes()


def stored_name(config: ModelConfig) -> Callable[[str], str]:
    """A stored tensor's name -> the name expected_shapes gives it."""
    own = of(config).stored_name
    if config.vision is None:
        return own
    vision = config.vision
    return lambda name: own(vision.stored_name(name))


def num_parameters(config: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in expected_shapes(config).values())
