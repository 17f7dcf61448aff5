"""The Triton element-wise kernels (kernels/gpu/layer_ops.py) against the torch reference,
on PDSERVE_TEST_DEVICE: interpreted on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from services.model.config import ModelConfig
from services.model.kernels import gpu
from services.model.kernels.gpu.layer_ops import TritonLayerOps
from services.model.layers.layer_ops import TorchLayerOps
from services.model.layers.rope import Rotary
from tests.support.devices import test_device

DEVICE = test_device()
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not gpu.interpreted(),
    reason="torch sees a GPU, so Triton compiles for it: run with PDSERVE_TEST_DEVICE=cuda",
)

# (rtol, atol) against TorchLayerOps on the same device. Interpreted, the kernels do numpy's
# float32 arithmetic and round where torch rounds: bfloat16 agrees bit for bit, float32 within
# 3.5e-7 relative (a sum's order in the norm, exp's last bit in silu; rotary is exact), the
# worst of 20 seeds. On a GPU, Triton's exp and rsqrt are approximations (not yet measured
# there): float32 within 1e-5, bfloat16 within one ulp (2^-7 relative).
TOLERANCES = {
    "cpu": {torch.float32: (1e-6, 0.0), torch.bfloat16: (0.0, 0.0)},
    "cuda": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-5)},
}
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


def _config(heads: int = 3, kv_heads: int = 1, head_dim: int = 64, hidden: int = 96) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=hidden,
        intermediate_size=160,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_bias=False,
    )


def _ops(dtype: torch.dtype, config: ModelConfig) -> tuple[TritonLayerOps, TorchLayerOps]:
    rotary = Rotary(config, dtype, DEVICE)
    return TritonLayerOps(config, rotary), TorchLayerOps(config, rotary)


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[DEVICE.type][expected.dtype]
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


def _positions(rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows)
    return torch.randint(0, 4096, (rows,), generator=gen).to(DEVICE)


# GQA groups of 1, 3 and 8; head_dim 96 masks half its rotary block (48 of 64); 16 + 2 heads
# of 128: a program rotates 16 (token, head) pairs (1024 half-head elements), a token spans two
ROTARY_SHAPES = [
    pytest.param(2, 2, 64, 37, id="mha-d64-rows37"),
    pytest.param(3, 1, 96, 5, id="gqa3-d96-rows5"),
    pytest.param(16, 2, 128, 1, id="gqa8-d128-rows1"),
    pytest.param(8, 1, 64, 5, id="gqa8-d64-rows5"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rows"), ROTARY_SHAPES)
def test_rotary_matches_torch(dtype, heads, kv_heads, head_dim, rows):
    kernel, reference = _ops(dtype, _config(heads, kv_heads, head_dim))
    c = kernel.config
    qkv = _randn(rows, c.q_size + 2 * c.kv_size, dtype=dtype)
    positions = _positions(rows)
    got = kernel.rotary(qkv, kernel.positions(positions))
    expected = reference.rotary(qkv, reference.positions(positions))
    for a, b in zip(got, expected, strict=True):
        _assert_close(a, b)
    assert got[2].data_ptr() == qkv[:, c.q_size + c.kv_size :].data_ptr()  # v: a view


def test_add_rms_norm_into_a_float32_residual_matches_torch():
    """h float32 (the decoder's residual stream), weight and delta bfloat16: out bfloat16."""
    kernel, reference = _ops(torch.bfloat16, _config(hidden=96))
    h = _randn(37, 96, dtype=torch.float32, scale=3.0)
    delta, weight = _randn(37, 96, dtype=torch.bfloat16), _randn(96, dtype=torch.bfloat16)
    h_kernel, h_reference = h.clone(), h.clone()
    got = kernel.add_rms_norm(h_kernel, delta, weight, 1e-5)
    expected = reference.add_rms_norm(h_reference, delta, weight, 1e-5)
    assert torch.equal(h_kernel, h + delta.float())
    assert got.dtype == torch.bfloat16
    _assert_close(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hidden", "rows"), [(96, 37), (576, 5), (576, 1)])
def test_add_rms_norm_matches_torch(dtype, hidden, rows):
    kernel, reference = _ops(dtype, _config(hidden=hidden))
    h, delta = _randn(rows, hidden, dtype=dtype, scale=3.0), _randn(rows + 1, hidden, dtype=dtype)
    delta, weight = delta[1:], _randn(hidden, dtype=dtype)
    h_kernel, h_reference = h.clone(), h.clone()
    got = kernel.add_rms_norm(h_kernel, delta, weight, 1e-5)
    expected = reference.add_rms_norm(h_reference, delta, weight, 1e-5)
    assert torch.equal(h_kernel, h + delta)  # the residual add: in place, one rounding
    _assert_close(got, expected)
    # without delta, h is left alone
    _assert_close(kernel.add_rms_norm(h_kernel, None, weight, 1e-5), expected)
    assert torch.equal(h_kernel, h + delta)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("ff", "rows"), [(160, 37), (1500, 5), (1, 1)])  # 1500: two blocks
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_silu_mul_matches_torch_over_the_whole_range(dtype, ff, rows):
    """exp(-gate) overflows to inf for gate < -88 (silu is then -0, as torch's); interpreted,
    numpy warns of it."""
    kernel, reference = _ops(dtype, _config())
    gate_up = _randn(rows, 2 * ff, dtype=dtype, scale=30.0)
    got = kernel.silu_mul(gate_up)
    assert got.shape == (rows, ff)
    _assert_close(got, reference.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_are_read_and_written_through_their_strides(dtype):
    """h a column slice of a wider tensor (updated in place, its neighbours untouched), delta,
    qkv and gate_up transposed: a column stride other than 1."""
    kernel, reference = _ops(dtype, _config())
    c = kernel.config
    wide = _randn(5, 100, dtype=dtype, scale=3.0)
    h, before = wide[:, 2:98], wide.clone()
    delta, weight = _randn(96, 5, dtype=dtype).T, _randn(96, dtype=dtype)
    got = kernel.add_rms_norm(h, delta, weight, 1e-5)
    expected_h = before[:, 2:98] + delta
    assert torch.equal(h, expected_h)
    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(wide[:, 98:], before[:, 98:])
    _assert_close(got, reference.add_rms_norm(expected_h.clone(), None, weight, 1e-5))

    qkv = _randn(c.q_size + 2 * c.kv_size, 5, dtype=dtype).T
    at = _positions(5)
    got_qkv = kernel.rotary(qkv, kernel.positions(at))
    for a, b in zip(got_qkv, reference.rotary(qkv, reference.positions(at)), strict=True):
        _assert_close(a, b)

    gate_up = _randn(320, 5, dtype=dtype, scale=3.0).T
    _assert_close(kernel.silu_mul(gate_up), reference.silu_mul(gate_up))


def test_positions_are_contiguous_int64():
    kernel, _ = _ops(torch.float32, _config())
    at = kernel.positions(torch.arange(10, dtype=torch.int32, device=DEVICE)[::2])
    assert isinstance(at, torch.Tensor) and at.dtype == torch.int64 and at.is_contiguous()
    assert at.tolist() == [0, 2, 4, 6, 8]
