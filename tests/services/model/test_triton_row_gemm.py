"""The row-invariant product (services/model/kernels/gpu/row_gemm.py): a row's bits are the same at
1, 7, 64 and 300 rows and wherever the row sits among them, float32 and bfloat16, with and
without a bias; and the product is x @ W^T (float32: within 2e-6 relative of float64's;
bfloat16: one rounding of the float32 sum). On this CPU under Triton's interpreter;
PDSERVE_TEST_DEVICE=cuda runs the same tests compiled on a GPU (bench/gpu_check does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.model.kernels import gpu
from services.model.kernels.gpu.row_gemm import RowInvariantLinear, row_matmul
from tests.support.devices import test_device

DEVICE = test_device()
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not gpu.interpreted(),
    reason="torch sees a GPU: run these with PDSERVE_TEST_DEVICE=cuda",
)
IN, OUT = 200, 96  # k past three steps with a tail; two column tiles, the second partial


@pytest.fixture(autouse=True)
def rows_multiplied_alike(monkeypatch):
    """Under the interpreter `tl.dot` is numpy's matmul of a whole tile, and its BLAS may sum
    a tile's edge rows in another order than the others (OpenBLAS did on a Zen 4 EPYC: row 63
    of 64). The kernel's tiles and summation order are what these tests are about, so each
    row of a tile is multiplied on its own, the same way wherever it sits, as a GPU's MMA
    sums every row of a tile."""
    if DEVICE.type != "cpu":
        return
    from triton.runtime import interpreter

    whole = np.matmul

    def by_row(a: np.ndarray, b: np.ndarray, **kwargs: object) -> np.ndarray:
        if a.ndim != 2:
            return whole(a, b, **kwargs)
        return np.concatenate([whole(a[i : i + 1], b, **kwargs) for i in range(a.shape[0])])

    monkeypatch.setattr(interpreter.np, "matmul", by_row)


def tensors(rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, IN, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_a_rows_bits_do_not_depend_on_the_batch(dtype, with_bias):
    weight = (torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) / 14).to(dtype)
    bias = torch.randn(OUT).to(dtype).to(DEVICE) if with_bias else None
    linear = RowInvariantLinear(weight.to(DEVICE), bias)
    row = tensors(1, dtype, seed=2)
    alone = linear(row)
    for rows, at in ((7, 3), (64, 17), (64, 63), (300, 0), (300, 211)):
        x = tensors(rows, dtype, seed=rows)
        x[at] = row[0]
        got = linear(x)
        assert torch.equal(got[at].view(torch.uint8), alone[0].view(torch.uint8)), (rows, at)
    x = tensors(300, dtype, seed=5)
    exact = x.double() @ weight.to(DEVICE).double().T + (0 if bias is None else bias.double())
    got = linear(x).double()
    if dtype == torch.float32:
        assert torch.allclose(got, exact, rtol=2e-6, atol=2e-6)
    else:  # the float32 sum of bfloat16 products, rounded once
        assert torch.allclose(got, exact.to(torch.bfloat16).double(), rtol=2**-7, atol=2**-7)


def test_no_rows_give_an_empty_product():
    weight = torch.randn(OUT, IN).to(DEVICE)
    assert row_matmul(torch.empty(0, IN, device=DEVICE), weight).shape == (0, OUT)
