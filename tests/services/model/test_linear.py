"""Prepacked products (oneDNN's, and AMX tiles' where they run) against the plain matmul they
replace, and row for row against themselves at every row count."""

from __future__ import annotations

import pytest
import torch

from services.model import kernels
from services.model.layers.linear import (
    AmxLinear,
    Bf16Linear,
    DenseLinear,
    PackedLinear,
    amx_linear_library,
    bf16_linear_library,
    make_linear,
    packed_linear_available,
)
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
    if dtype == torch.bfloat16 and (amx := amx_linear_library()) is not None:
        linears.append(AmxLinear(amx, weight, bias))
    for linear in linears:
        out = linear(x)
        assert out.dtype == dtype and out.shape == (7, out_f)
        assert (out.float() - reference).abs().max().item() < tol


# Row counts the model's products see: decode batches, prefill chunks of a 512-token budget
# (whole, cut on 16- and 256-token grids, plus a few decode rows), lone rows; tails of the
# kernels' blocks around powers of two.
ROW_COUNTS = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129,
              255, 256, 257, 300, 383, 511, 512, 513, 520, 600]  # fmt: skip


# oneDNN in every dtype the CPU computes in; the AMX tiles take bfloat16 only
KINDS = [
    pytest.param(p.values[0], kind, marks=p.marks, id=f"{p.id}-{kind}")
    for p in COMPUTE_DTYPES
    for kind in ("onednn", "amx")
    if kind == "onednn" or p.values[0] == "bfloat16"
]


@pytest.mark.all_cores  # (tests/conftest.py)
@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
@pytest.mark.parametrize(("dtype", "kind"), KINDS)
def test_a_row_does_not_depend_on_the_other_rows(out_f, in_f, dtype, kind):
    """What makes a request's logits the same alone or in any batch: each row of a product
    gets the same bits whatever the number of rows (oneDNN picks kernels by shape; on this
    CPU, for these shapes, they all sum a row the same way; the AMX kernel sums each row by
    one fixed sequence of tile products)."""
    dtype = DTYPES[dtype]
    if not packed_linear_available(CPU, dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    amx = amx_linear_library()
    if kind == "amx" and amx is None:
        pytest.skip("AMX products: on CPUs whose tiles run")
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)
    linear = AmxLinear(amx, weight) if amx is not None and kind == "amx" else PackedLinear(weight)
    counts = ROW_COUNTS if out_f < 10_000 else [m for m in ROW_COUNTS if m <= 129]  # the head
    x = torch.randn(max(counts), in_f, generator=gen).to(dtype)
    every = linear(x)
    for m in counts:
        assert torch.equal(linear(x[:m]), every[:m]), f"{m} rows"


@pytest.mark.parametrize(("out_f", "in_f"), SHAPES[:4])
@pytest.mark.parametrize(("dtype", "kind"), [*KINDS, pytest.param("bfloat16", "bf16_linear")])
def test_a_slice_of_the_columns_gives_the_same_bits(out_f, in_f, dtype, kind):
    """What exact tensor parallelism stands on (docs/parallel.md): a rank holding some of a
    weight's output columns computes those columns' bits as the whole weight does, at every
    row count, so splitting by columns and gathering changes no answer."""
    dtype = DTYPES[dtype]
    amx, bf16 = amx_linear_library(), bf16_linear_library()
    if kind == "onednn" and not packed_linear_available(CPU, dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    if kind == "amx" and amx is None:
        pytest.skip("AMX products: on CPUs whose tiles run")
    if kind == "bf16_linear" and bf16 is None:
        pytest.skip("no AVX512-BF16 here (or no C compiler)")

    def product(w: torch.Tensor) -> AmxLinear | Bf16Linear | PackedLinear:
        if kind == "amx":
            assert amx is not None
            return AmxLinear(amx, w)
        if kind == "bf16_linear":
            assert bf16 is not None
            return Bf16Linear(bf16, w, out_dtype=torch.bfloat16)
        return PackedLinear(w)

    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)
    whole = product(weight)
    for parts in (2, 3):
        step = out_f // parts  # whole panels of 16 columns: 576 / 3 = 192
        slices = [product(weight[j * step : (j + 1) * step].contiguous()) for j in range(parts)]
        for m in (1, 7, 300):
            x = torch.randn(m, in_f, generator=gen).to(dtype)
            every = whole(x)
            for j, piece in enumerate(slices):
                cols = slice(j * step, (j + 1) * step)
                assert torch.equal(piece(x), every[:, cols]), f"{parts} parts, {m} rows, {j}"


@pytest.mark.skipif(
    not packed_linear_available(torch.device("cpu"), torch.bfloat16),
    reason="oneDNN packs no bfloat16 weights on this CPU (it needs avx512bw/vl/dq or "
    "avx_ne_convert): bfloat16 products stay plain matmuls here",
)
def test_products_are_chosen_per_weight_and_machine(monkeypatch):
    """bfloat16 weights that fit the tiles take them where a probe ran one (and PDSERVE_AMX is
    not 0), else kernels/bf16_linear.c's products where the CPU has AVX512-BF16; shapes off the
    tiles' grid beside AMX, and float32, stay on oneDNN; a plain matmul when not packed."""
    weight = torch.randn(64, 64).to(torch.bfloat16)
    amx = amx_linear_library()
    bf16 = Bf16Linear if bf16_linear_library() is not None else PackedLinear
    chosen = make_linear(weight, packed=True, amx=amx)
    assert isinstance(chosen, AmxLinear if amx is not None else bf16)
    off_grid = make_linear(weight[:, :48], packed=True, amx=amx)
    assert isinstance(off_grid, PackedLinear if amx is not None else bf16)
    assert isinstance(make_linear(weight.float(), packed=True, amx=amx), PackedLinear)
    assert isinstance(make_linear(weight, packed=False, amx=amx), DenseLinear)
    try:
        monkeypatch.setenv("PDSERVE_AMX", "0")
        amx_linear_library.cache_clear()
        kernels.amx_usable.cache_clear()
        assert amx_linear_library() is None
    finally:
        monkeypatch.delenv("PDSERVE_AMX")
        amx_linear_library.cache_clear()
        kernels.amx_usable.cache_clear()
    assert (amx_linear_library() is None) == (amx is None)


@pytest.mark.all_cores  # (tests/conftest.py)
def test_amx_rows_past_a_whole_tile_and_bias():
    """Row counts that end inside a tile (read from a zero-padded copy), columns in a lone
    16-column tile, a bias added in float32 before the one rounding to bfloat16."""
    amx = amx_linear_library()
    if amx is None:
        pytest.skip("AMX products: on CPUs whose tiles run")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    linear = AmxLinear(amx, weight, bias)
    for rows in (1, 5, 17, 33, 47):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        exact = x.double() @ weight.double().t() + bias.double()
        # float32 sums of exact bfloat16 products, then one rounding: within a bfloat16 ulp
        out = linear(x)
        assert out.shape == (rows, 48) and out.dtype == torch.bfloat16
        assert torch.all((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4)
    assert linear(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 48)
