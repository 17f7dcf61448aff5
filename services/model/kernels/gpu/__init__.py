"""Triton kernels behind the model's seams (`Attention`, `LayerOps`) and CUDA graphs.

Compiled for the GPU where torch sees a CUDA device; elsewhere Triton's interpreter runs the
same kernels on the CPU (TRITON_INTERPRET=1, set here before any kernel is defined: the
interpreter is chosen when `triton.jit` wraps a function), which is how the CPU test suite
checks them against their torch references. Interpreted kernels are for tests, not for
speed: `--kernels triton` on a CPU is orders of magnitude slower than the C kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def available() -> bool:
    """Whether triton imports here (it is a dependency; a broken install says so)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
