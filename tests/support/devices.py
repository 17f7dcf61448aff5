"""The device the kernel tests run on: PDSERVE_TEST_DEVICE, "cpu" unless set. On a CPU the
Triton kernels run in Triton's interpreter (model/kernels/gpu sets it up); a GPU machine runs
the same tests compiled with PDSERVE_TEST_DEVICE=cuda."""

from __future__ import annotations

import os

import torch


def test_device() -> torch.device:
    return torch.device(os.environ.get("PDSERVE_TEST_DEVICE", "cpu"))


test_device.__test__ = False  # a helper: pytest would collect it wherever it is imported
