"""What every section of settings is made of (services/settings/sections.py): the roles, a
setting's field with its metadata, the section base that checks choices and minimums, and
the error a value that cannot be used raises."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field, fields
from typing import Any

ROLES = ("router", "prefill", "decode", "encode", "up")
WORKER = ("prefill", "decode", "up")
ENCODE = (*WORKER, "encode")  # what an encode worker takes too (model, dtype, the store)
ROUTER = ("router", "up")
EVERY = ROLES
OFFLINE = ("generate",)  # `pdserve generate` takes the model's settings
DEFAULT_PORTS = {"router": 8000, "prefill": 50051, "decode": 50052, "encode": 50053, "up": 8000,
                 "generate": 0}  # fmt: skip
SECRETS = ("api_keys", "admin_key")  # shown as <set>
SPECULATIVE_METHODS = ("ngram", "suffix", "draft", "mtp")
GIB = 1 << 30


class SettingsError(ValueError):
    """A value that cannot be used; the message names where it came from."""


def setting(default: Any, help: str, roles: Sequence[str], **extra: Any) -> Any:
    """A setting's field. `extra`: `choices`, `minimum`, and `name` where the setting's flat
    name (flag, variable, file key) is not the field's."""
    return field(default=default, metadata={"help": help, "roles": tuple(roles), **extra})


class Section:
    """A group of settings; values out of their field's choices or below its minimum are
    refused however the section is made (the loader names the flag or variable first)."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            v, choices = getattr(self, f.name), f.metadata.get("choices")
            minimum = f.metadata.get("minimum")
            if choices and v not in choices:
                raise SettingsError(f"{f.name}: {v!r} is not one of {', '.join(choices)}")
            if minimum is not None and v is not None and v < minimum:
                raise SettingsError(f"{f.name}: must be at least {minimum}, got {v}")
