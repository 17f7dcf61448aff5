"""Prepacked oneDNN products against the plain matmul they replace."""

from __future__ import annotations

import pytest
import torch

from services.model.linear import DenseLinear, PackedLinear, packed_linear_available

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


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
def test_a_row_does_not_depend_on_the_other_rows(out_f, in_f):
    """What makes a request's logits the same alone or in any batch."""
    gen = torch.Generator().manual_seed(1)
    linear = PackedLinear(torch.randn(out_f, in_f, generator=gen))
    row = torch.randn(1, in_f, generator=gen)
    alone = linear(row)[0]
    for others in (1, 2, 6, 63, 300):
        batch = torch.cat([torch.randn(others, in_f, generator=gen), row])
        assert torch.equal(linear(batch)[-1], alone), f"{others} other rows"
