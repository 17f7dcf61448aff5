"""Errors raised while finding and loading a model."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(Exception):
    """A checkpoint that cannot be loaded; the message is one line naming the file and why."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
