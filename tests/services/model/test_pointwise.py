"""kernels/pointwise.c: an element's exp, log1p, cos and sin depend on its value alone, not on
where it lies in the tensor (torch's vector routine and libm tail disagree in the last bits);
and the functions built on them follow torch's."""

from __future__ import annotations

import pytest
import torch

from services.model import kernels
from services.model.layers import pointwise

pytestmark = pytest.mark.skipif(
    kernels.load("pointwise") is None, reason="no C compiler: torch's functions stand in"
)


@pytest.mark.all_cores  # (tests/conftest.py)
@pytest.mark.parametrize("name", ["exp", "log1p", "cos", "sin", "tanh"])
def test_an_element_gets_the_same_bits_alone_and_at_any_offset_of_any_length(name):
    fn, ref = getattr(pointwise, name), getattr(torch, name)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 4
    if name == "log1p":
        x = x.abs()  # its domain
    alone = torch.stack([fn(x[i : i + 1])[0] for i in range(len(x))])
    for n in (1000, 999, 517, 33):
        assert torch.equal(fn(x[:n]), alone[:n]), n
    assert torch.allclose(alone, ref(x), rtol=1e-6, atol=1e-7)  # torch's, within an ulp or so


def test_the_functions_built_on_them_follow_torch():
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) * 6
    x[0, 0] = 30.0  # softplus's linear branch
    close = {"rtol": 1e-6, "atol": 1e-6}
    assert torch.allclose(pointwise.sigmoid(x), torch.sigmoid(x), **close)
    assert torch.allclose(pointwise.silu(x), torch.nn.functional.silu(x), **close)
    assert torch.allclose(pointwise.softplus(x), torch.nn.functional.softplus(x), **close)
    gelu = torch.nn.functional.gelu(x, approximate="tanh")
    assert torch.allclose(pointwise.gelu_tanh(x), gelu, **close)
    assert torch.allclose(pointwise.softmax(x, 1), x.softmax(1), **close)
    assert torch.allclose(pointwise.softmax(x, 0), x.softmax(0), **close)
    assert torch.equal(
        pointwise.ordered_sum(x, 1),
        ((((x[:, 0] + x[:, 1]) + x[:, 2]) + x[:, 3]) + x[:, 4] + x[:, 5] + x[:, 6] + x[:, 7]),
    )
