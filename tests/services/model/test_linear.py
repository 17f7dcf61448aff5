"""Prepacked oneDNN products against the plain matmul they replace."""

from __future__ import annotations

import pytest
import torch

from services.model.linear import DenseLinear, PackedLinear, packed_linear_available
from services.model.loader import DTYPES
from tests.support.dtypes import COMPUTE_DTYPES

CPU = torch.device("cpu")
# (out, in) of the embedded model's four layer products and its output head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]

pytestmark = pytest.mark.skipif(
    not packed_linear_available(CPU, torch.float32), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_packed_matches_dense(out_f, in_f, dtype, tol):
    gen = torch.Generator().manual_seed(out_f + in_f)
    weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)
    bias = torch.randn(out_f, generator=gen).to(dtype)
    x = torch.randn(7, in_f, generator=gen).to(dtype)
    reference = (x.double() @ weight.double().t() + bias.double()).float()
    linears = [DenseLinear(weight, bias)]
    if packed_linear_available(CPU, dtype):  # oneDNN's bf16 packing needs AVX512 or AVX-NE
        linears.append(PackedLinear(weight, bias))
    for linear in linears:
        out = linear(x)
        assert out.dtype == dtype and out.shape == (7, out_f)
        assert (out.float() - reference).abs().max().item() < tol


# Row counts the model's products see: decode batches, prefill chunks of a 512-token budget
# (whole, cut on 16- and 256-token grids, plus a few decode rows), lone rows; tails of the
# kernels' blocks around powers of two.
ROW_COUNTS = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129,
              255, 256, 257, 300, 383, 511, 512, 513, 520, 600]  # fmt: skip


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_a_row_does_not_depend_on_the_other_rows(out_f, in_f, dtype):
    """What makes a request's logits the same alone or in any batch: each row of a product
    gets the same bits whatever the number of rows (oneDNN picks kernels by shape; on this
    CPU, for these shapes, they all sum a row the same way)."""
    dtype = DTYPES[dtype]
    if not packed_linear_available(CPU, dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    gen = torch.Generator().manual_seed(1)
    linear = PackedLinear((torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype))
    counts = ROW_COUNTS if out_f < 10_000 else [m for m in ROW_COUNTS if m <= 129]  # the head
    x = torch.randn(max(counts), in_f, generator=gen).to(dtype)
    every = linear(x)
    for m in counts:
        assert torch.equal(linear(x[:m]), every[:m]), f"{m} rows"
