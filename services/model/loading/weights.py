"""Checks shared by every checkpoint reader."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from services.model import families
from services.model.config import ModelConfig
from services.model.errors import ModelLoadError


def check_shapes(path: Path, config: ModelConfig, shapes: Mapping[str, Sequence[int]]) -> None:
    """Each tensor the config names has the shape the config implies (others are ignored)."""
    expected = families.expected_shapes(config)
    for name, shape in shapes.items():
        if name in expected and tuple(shape) != expected[name]:
            raise ModelLoadError(
                path,
                f"tensor {name!r} has shape {tuple(shape)}, the config implies {expected[name]}",
            )


def check_complete(
    path: Path, config: ModelConfig, names: Collection[str], only: tuple[str, ...] = ("",)
) -> None:
    """Every tensor the config implies (whose name starts with one of `only`) is present."""
    wanted = {n for n in families.expected_shapes(config) if n.startswith(only)}
    missing = sorted(wanted - set(names))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(path, f"tensor {missing[0]!r} is missing{more}")
