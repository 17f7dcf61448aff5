"""What a model family declares: the checkpoints it serves, how it reads them, and its model.

A family is one place under services/model/families/: a module or a folder whose `FAMILY` says
everything the rest of the code asks of it. Nothing outside a family branches on which family
a config is (tests/test_families_layout.py); loading, config parsing and shape checks look the
family up (families/__init__.py). The declaration imports no torch (the router reads configs);
the model class is imported when a model is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.model.config import ModelConfig


def _same(name: str) -> str:
    return name


@dataclass(frozen=True)
class Family:
    name: str
    # Hugging Face `architectures` class names, each with the model_type it is read as
    architectures: Mapping[str, str]
    # config.json (generation_config's end tokens merged in) read as `model_type`: a
    # ModelConfig, or ModelLoadError / KeyError / ValueError for what the family cannot serve
    read_config: Callable[[dict[str, Any], str], ModelConfig]
    # every tensor the config calls for, by name as `stored_name` gives it, and its shape
    expected_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    # "module:Class" of the model (a CausalLM), imported only when one is built
    model: str
    # a stored tensor's name as expected_shapes spells it (DeepSeek-V4's own checkpoints)
    stored_name: Callable[[str], str] = _same
    # an FP8 weight's block scales' name, for a family that reads and checks them itself
    # (DeepSeek-V4's `<name>.scale`); None: `<name>.weight_scale_inv`, checked at load
    own_scales: Callable[[str], str] | None = None
    # the module serving the family's multi-token-prediction layer: `check_mtp(path, config)`
    # (ModelLoadError where the checkpoint has none) and `load_mtp(path, config, dtype,
    # device, kernels, deterministic)` -> a causal_lm.MtpLayer; None: the family has none
    mtp: str | None = None
    # the module splitting the family's model over tensor ranks (parallel/plan.py asks it:
    # `sizes`, `rows`, `sliced`, `cache_whole`, `parallelize`); None: the Llama family's
    # decoder and DeepSeek-V2/V3 split as plan.py and tensor.py do, other models refused
    tensor: str | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.architectures.values()))

    def model_class(self) -> Any:
        return load_symbol(self.model)

    def mtp_module(self) -> Any:
        return None if self.mtp is None else importlib.import_module(self.mtp)

    def tensor_module(self) -> Any:
        return None if self.tensor is None else importlib.import_module(self.tensor)


def load_symbol(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
