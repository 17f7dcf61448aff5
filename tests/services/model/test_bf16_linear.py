"""The output head's bfloat16 product with float32 sums (kernels/bf16_linear.c) against the
exact product of the same bfloat16 numbers, and row for row against itself."""

from __future__ import annotations

import pytest
import torch

from services.model.layers.linear import (
    Bf16Linear,
    PackedLinear,
    bf16_linear_library,
    make_logits_linear,
)

LIBRARY = bf16_linear_library()
pytestmark = pytest.mark.skipif(
    LIBRARY is None, reason="no AVX512-BF16 here (or no C compiler): the head rounds to bfloat16"
)
# (out, in): the embedded model's head and its o product (9 column groups: the threads split
# the rows too), and sizes that leave partial panels and tiles
SHAPES = [(49152, 576), (576, 576), (37, 64), (100, 96), (16, 2)]


def _inputs(out_f: int, in_f: int, rows: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(out_f * in_f)
    weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).bfloat16()
    bias = torch.randn(out_f, generator=gen)
    return weight, bias, torch.randn(rows, in_f, generator=gen).bfloat16()


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_sums_are_float32_not_rounded_to_bfloat16(out_f, in_f, with_bias):
    assert LIBRARY is not None
    weight, bias, x = _inputs(out_f, in_f, 13)
    head = Bf16Linear(LIBRARY, weight, bias if with_bias else None)
    got = head(x)
    exact = x.double() @ weight.double().t() + (bias.double() if with_bias else 0)
    assert got.dtype == torch.float32 and got.shape == (13, out_f)
    # float32 sums of exact products: far inside one bfloat16 step (2^-8 relative)
    assert ((got.double() - exact).abs() <= 1e-5 * (1 + exact.abs())).all()
    rounded = Bf16Linear(LIBRARY, weight, bias if with_bias else None, torch.bfloat16)(x)
    assert torch.equal(rounded, got.bfloat16())  # the bfloat16 results: the same sums, rounded


@pytest.mark.all_cores  # (tests/conftest.py): threads split the columns at these sizes
@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
def test_a_row_has_the_same_bits_at_every_row_count(out_f, in_f):
    assert LIBRARY is not None
    weight, _, x = _inputs(out_f, in_f, 40)
    head = Bf16Linear(LIBRARY, weight)
    every = head(x)
    for rows in (slice(0, 1), slice(39, 40), slice(5, 12), slice(3, 40), slice(0, 6)):
        assert torch.equal(head(x[rows]), every[rows]), f"rows {rows}"
    assert head(x[:0]).shape == (0, out_f)


def test_the_head_keeps_float32_sums_in_bfloat16_only():
    assert LIBRARY is not None
    weight, _, _ = _inputs(64, 32, 1)
    assert isinstance(make_logits_linear(weight, True, None, False), Bf16Linear)
    f32 = make_logits_linear(weight.float(), True, None, False)
    assert isinstance(f32, PackedLinear)  # float32 weights: oneDNN's float32 product
