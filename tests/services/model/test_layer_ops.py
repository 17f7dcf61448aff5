"""The C element-wise kernels (kernels/layer_ops.c) against the torch reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.model import kernels
from services.model.config import ModelConfig
from services.model.layers.layer_ops import CpuLayerOps, TorchLayerOps, default_layer_ops, rms_norm
from services.model.layers.rope import Rotary

LIBRARY = kernels.load("layer_ops")
needs_kernel = pytest.mark.skipif(LIBRARY is None, reason="no C compiler here")
DTYPES = [torch.float32, torch.bfloat16]


def _config(head_dim: int = 64, hidden: int = 96) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=hidden,
        intermediate_size=160,
        num_layers=1,
        num_heads=5,
        num_kv_heads=1,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_bias=False,
    )


def _ops(dtype: torch.dtype) -> tuple[CpuLayerOps, TorchLayerOps]:
    assert LIBRARY is not None
    config = _config()
    rotary = Rotary(config, dtype, torch.device("cpu"))
    return CpuLayerOps(config, rotary, LIBRARY), TorchLayerOps(config, rotary)


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bit_identical_to_torch(dtype):
    kernel, reference = _ops(dtype)
    c = kernel.config
    qkv = _randn(300, c.q_size + 2 * c.kv_size, dtype=dtype)
    positions = torch.randint(0, 4096, (300,), generator=torch.Generator().manual_seed(1))
    got = kernel.rotary(qkv, kernel.positions(positions))
    expected = reference.rotary(qkv, reference.positions(positions))
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == dtype
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 0.0)])
def test_add_rms_norm_matches_torch(dtype, tol):
    kernel, reference = _ops(dtype)
    h, delta = _randn(300, 96, dtype=dtype, scale=3.0), _randn(301, 96, dtype=dtype)[1:]
    weight = _randn(96, dtype=dtype)
    h_kernel, h_reference = h.clone(), h.clone()
    got = kernel.add_rms_norm(h_kernel, delta, weight, 1e-5)
    expected = reference.add_rms_norm(h_reference, delta, weight, 1e-5)
    assert torch.equal(h_kernel, h_reference)  # the residual add: one rounding, the same
    assert got.dtype == dtype
    assert (got.float() - expected.float()).abs().max().item() <= tol
    # without delta, h is left alone
    before = h.clone()
    kernel.add_rms_norm(h, None, weight, 1e-5)
    assert torch.equal(h, before)


@needs_kernel
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
def test_silu_mul_matches_torch_over_the_whole_range(dtype, tol):
    kernel, reference = _ops(dtype)
    gate_up = _randn(64, 320, dtype=dtype, scale=30.0)  # exp's arguments far past +-88
    got, expected = kernel.silu_mul(gate_up), reference.silu_mul(gate_up)
    assert got.shape == (64, 160)
    # relative to the value, but silu(x) for x < -88 is a float32 denormal (below 1e-34)
    # where torch flushes it to 0: there the difference is absolute
    error = (got.float() - expected.float()).abs()
    assert (error <= tol * expected.float().abs() + 1e-34).all()


@needs_kernel
def test_add_rms_norm_into_a_float32_residual_rounds_once():
    """A float32 residual stream beside bfloat16 weights (the decoder's): h += delta exactly in
    float32, out = bfloat16(weight * h * rsqrt(mean(h^2) + eps)), as TorchLayerOps computes."""
    kernel, reference = _ops(torch.bfloat16)
    h = _randn(300, 96, dtype=torch.float32, scale=3.0)
    delta, weight = _randn(300, 96, dtype=torch.bfloat16), _randn(96, dtype=torch.bfloat16)
    h_kernel, h_reference = h.clone(), h.clone()
    got = kernel.add_rms_norm(h_kernel, delta, weight, 1e-5)
    expected = reference.add_rms_norm(h_reference, delta, weight, 1e-5)
    assert torch.equal(h_kernel, h + delta.float()) and h_kernel.dtype == torch.float32
    assert torch.equal(h_reference, h_kernel)
    assert got.dtype == torch.bfloat16
    # the kernel's sum of squares differs from torch's in a float32's last bits: at most one
    # bfloat16 step apart, and on almost every element the same
    step = expected.float().abs() * 2**-7
    assert ((got.float() - expected.float()).abs() <= step).all()
    assert (got != expected).float().mean() < 0.01
    # rounded once: not the twice-rounded norm of the same numbers in bfloat16
    twice = rms_norm(h_kernel.bfloat16(), weight, 1e-5)
    assert not torch.equal(got, twice)


@pytest.mark.all_cores  # (tests/conftest.py)
@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_batch(dtype):
    """Each row the same bits alone or among others, on one thread or split over several
    (calls past PARALLEL_ELEMS elements are)."""
    kernel, _ = _ops(dtype)
    c = kernel.config
    h, delta = _randn(600, 96, dtype=dtype), _randn(600, 96, dtype=dtype, scale=0.5)
    weight = _randn(96, dtype=dtype)
    qkv = _randn(600, c.q_size + 2 * c.kv_size, dtype=dtype)
    at = kernel.positions(torch.arange(600) * 3)
    gate_up = _randn(600, 320, dtype=dtype)
    every_h, every_wide = h.clone(), h.to(torch.float32, copy=True)
    every = (
        kernel.add_rms_norm(every_h, delta, weight, 1e-5),
        kernel.add_rms_norm(every_wide, delta, weight, 1e-5),  # a float32 residual
        *kernel.rotary(qkv, at)[:2],
        kernel.silu_mul(gate_up),
    )
    for rows in (slice(7, 8), slice(0, 1), slice(100, 300), slice(599, 600)):
        some_h, some_wide = h[rows].clone(), h[rows].to(torch.float32, copy=True)
        some = (
            kernel.add_rms_norm(some_h, delta[rows], weight, 1e-5),
            kernel.add_rms_norm(some_wide, delta[rows], weight, 1e-5),
            *kernel.rotary(qkv[rows], kernel.positions(torch.arange(600)[rows] * 3))[:2],
            kernel.silu_mul(gate_up[rows]),
        )
        assert torch.equal(some_h, every_h[rows]) and torch.equal(some_wide, every_wide[rows])
        for got, expected in zip(some, every, strict=True):
            assert torch.equal(got, expected[rows]), f"rows {rows}"


def test_kernels_only_for_row_lengths_they_take():
    """Each op falls back to torch for the rows it does not take (a head whose half is not a
    whole vector of 16, a norm or an MLP width that is not a multiple of 16): the same
    results as the reference, bit for bit; float16 has no kernels at all."""
    cpu = torch.device("cpu")
    odd = _config(head_dim=48, hidden=40)
    assert type(default_layer_ops(odd, Rotary(odd, torch.float16, cpu), cpu, torch.float16)) is (
        TorchLayerOps
    )
    if LIBRARY is None:
        return
    rotary = Rotary(odd, torch.float32, cpu)
    made = default_layer_ops(odd, rotary, cpu, torch.float32)
    assert isinstance(made, CpuLayerOps)
    reference = TorchLayerOps(odd, rotary)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, (5 + 2) * 48, generator=g)
    positions = torch.arange(7) * 5
    got = made.rotary(qkv, made.positions(positions))
    expected = reference.rotary(qkv, reference.positions(positions))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    h, weight = torch.randn(7, 40, generator=g), torch.randn(40, generator=g)
    assert torch.equal(made.add_rms_norm(h, None, weight, 1e-5), rms_norm(h, weight, 1e-5))
    gate_up = torch.randn(7, 2 * 24, generator=g)
    assert torch.equal(made.silu_mul(gate_up), reference.silu_mul(gate_up))


ROUTINGS: dict[
    str, dict[str, Any]
] = {  # MoeShape fields: Mixtral's, DeepSeek-V2's, DeepSeek-V3's (noaux_tc), Qwen3-MoE's
    "greedy": dict(num_experts=8, top_k=2),
    "group_limited_greedy": dict(
        num_experts=64, top_k=6, topk_method="group_limited_greedy", n_group=8, topk_group=3
    ),
    "noaux_tc": dict(
        num_experts=256,
        top_k=8,
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        scoring="sigmoid",
    ),
    "normalized": dict(num_experts=128, top_k=8, norm_topk_prob=True),
}


@needs_kernel
@pytest.mark.parametrize("routing", ROUTINGS)
def test_router_select_chooses_as_the_reference_row_by_row(routing):
    """The C kernel's experts equal torch's top-k (best first) for every routing, its weights
    within a float32 rounding of the normalization's sum, and a row's choice and weights are
    bit for bit the same alone as among 40 rows."""
    from services.model.config import MoeShape
    from services.model.layers.layer_ops import select_experts

    shape = MoeShape(intermediate_size=16, layers=(0,), **ROUTINGS[routing])
    cpu, _ = _ops(torch.float32)
    logits = _randn(40, shape.num_experts, dtype=torch.float32, scale=3.0)
    scores = cpu.router_scores(logits, sigmoid=shape.scoring == "sigmoid")
    bias = _randn(shape.num_experts, dtype=torch.float32) if routing == "noaux_tc" else None
    calls, kernel = [], cpu._select

    def counted(*args: object) -> None:
        calls.append(args)
        kernel(*args)

    cpu._select = counted
    weights, ids = cpu.router_select(scores, bias, shape)
    assert calls  # the C kernel's, not the reference's
    ref_weights, ref_ids = select_experts(scores, bias, shape)
    assert ids.shape == (40, shape.top_k) and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-7, atol=0)
    if shape.n_group > 1:  # every choice from a kept group: topk_group of them at most
        groups = ids // (shape.num_experts // shape.n_group)
        assert all(len(set(row)) <= shape.topk_group for row in groups.tolist())
    for row in (0, 17, 39):
        alone_w, alone_ids = cpu.router_select(scores[row : row + 1], bias, shape)
        assert torch.equal(alone_ids[0], ids[row]) and torch.equal(alone_w[0], weights[row])
