"""Errors raised while finding and loading a model, and running one over processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelLoadError(Exception):
    """A checkpoint that cannot be loaded; the message is one line naming the file and why."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class RankLost(RuntimeError):
    """Another process of the model stopped answering: the engine cannot finish a forward
    pass, and its worker leaves service."""


class DataRankLost(RankLost):
    """A data-parallel rank, or an expert rank of --expert-parallel, stopped answering its
    votes or exchanges (parallel/data.py, exchange.py)."""


class TensorRankLost(RankLost):
    """A rank holding a slice of every layer stopped answering (parallel/ranks.py)."""


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; anything else is a ModelLoadError naming it."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(path, f"not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data
