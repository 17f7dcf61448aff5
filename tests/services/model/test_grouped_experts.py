"""A MoE layer's routed experts in one call (kernels/bf16_linear.c bf16_experts, through
moe.run_grouped) against the arithmetic it stands for, and a choice's bits against itself
whatever else is routed in the same call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.model.layers.linear import (
    Bf16Linear,
    PackedLinear,
    bf16_linear_library,
    make_linear,
)
from services.model.layers.moe import DenseMlp, _grouped_library, run_grouped

LIBRARY = bf16_linear_library()
pytestmark = pytest.mark.skipif(
    LIBRARY is None, reason="no AVX512-BF16 here (or no C compiler): experts run one by one"
)
HIDDEN, FF, EXPERTS, K = 256, 96, 7, 3


def _experts() -> tuple[list[DenseMlp], list[tuple[torch.Tensor, torch.Tensor]]]:
    assert LIBRARY is not None
    gen = torch.Generator().manual_seed(3)
    modules, weights = [], []
    for _ in range(EXPERTS):
        gate_up = (torch.randn(2 * FF, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16()
        down = (torch.randn(HIDDEN, FF, generator=gen) / FF**0.5).bfloat16()
        bf16 = torch.bfloat16
        modules.append(
            DenseMlp(
                Bf16Linear(LIBRARY, gate_up, None, bf16), Bf16Linear(LIBRARY, down, None, bf16)
            )
        )
        weights.append((gate_up, down))
    return modules, weights


def _rows(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
    return x, torch.randint(0, EXPERTS, (tokens * K,), generator=gen)


def test_grouped_experts_compute_swiglu_with_float32_sums():
    modules, weights = _experts()
    x, keys = _rows(20, 1)
    assert _grouped_library(modules, x) is not None
    got = run_grouped(x, K, keys, modules, ops=None)  # type: ignore[arg-type]
    assert got.shape == (20 * K, HIDDEN) and got.dtype == torch.bfloat16
    for i, e in enumerate(keys.tolist()):
        gate_up, down = weights[e]
        h = x[i // K].double() @ gate_up.double().t()
        act = (F.silu(h[:FF]) * h[FF:]).bfloat16()
        expected = (act.double() @ down.double().t()).float()
        # the sums are float32 (one bfloat16 step is 2^-8 relative): the activation may round
        # the other way now and then, one step
        error = (got[i].float() - expected).abs()
        assert (error <= 2**-7 * expected.abs() + 2e-3).all(), i


@pytest.mark.all_cores  # (tests/conftest.py): threads split the columns
def test_a_choice_has_the_same_bits_whatever_shares_the_call():
    modules, _ = _experts()
    x, keys = _rows(40, 2)
    every = run_grouped(x, K, keys, modules, ops=None)  # type: ignore[arg-type]
    for tokens in (slice(0, 1), slice(39, 40), slice(5, 17), slice(0, 6)):
        choices = slice(tokens.start * K, tokens.stop * K)
        some = run_grouped(x[tokens], K, keys[choices], modules, ops=None)  # type: ignore[arg-type]
        assert torch.equal(some, every[choices]), tokens
    # one expert alone, called directly (a shared expert's way): its own rows, the same bits
    rows = (keys == 2).nonzero()[:, 0]
    alone = modules[2](x[rows // K], ops=_SiluMul())
    assert alone.shape == (len(rows), HIDDEN)
    assert torch.equal(alone, every[rows])  # its down product's rows split in parts there


class _SiluMul:
    """The layer ops' silu_mul (torch's), for an expert called by itself."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def test_experts_are_packed_for_the_grouped_call_only_in_bfloat16():
    weight = torch.randn(64, 32)
    assert isinstance(make_linear(weight.bfloat16(), None, True, None, False), Bf16Linear)
    assert isinstance(make_linear(weight, None, True, None, False), PackedLinear)
    modules, _ = _experts()
    x, _ = _rows(2, 3)
    assert _grouped_library(modules, x.float()) is None  # float32 rows: one by one
    # an expert width the kernel's SiLU does not take (a multiple of 32): one by one, and the
    # same SwiGLU
    assert LIBRARY is not None
    gate_up, down = torch.randn(96, HIDDEN).bfloat16(), torch.randn(HIDDEN, 48).bfloat16()
    odd = DenseMlp(
        Bf16Linear(LIBRARY, gate_up, None, torch.bfloat16),
        Bf16Linear(LIBRARY, down, None, torch.bfloat16),
    )
    assert _grouped_library([odd, odd], x) is None
    keys = torch.tensor([0, 1, 1, 0, 0, 1])
    out = run_grouped(x, K, keys, [odd, odd], _SiluMul())  # type: ignore[arg-type]
    assert torch.equal(out[0], odd(x[:1], _SiluMul())[0])  # type: ignore[arg-type]
