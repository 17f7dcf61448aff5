"""kernels/row_attention.c, each query row over its own list of keys with an optional sink per
head, against the torch reference (attend_row): float32 to a few ulp, bfloat16 as far as its
logits' rounding allows; and a row's result the same bits alone as among others."""

from __future__ import annotations

import pytest
import torch

from services.model.layers import row_attention
from services.model.layers.row_attention import attend_row, attend_rows
from tests.support.dtypes import COMPUTE_DTYPES

pytestmark = pytest.mark.skipif(
    row_attention._library() is None, reason="no C compiler: attend_rows runs attend_row"
)
LISTS = [[0, 1, 2], list(range(5, 40)), [1, 7, 30], [0], list(range(10, 20)), []]


@pytest.mark.all_cores  # (tests/conftest.py)
@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (8, 1, 33), (16, 1, 512)])
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_match_the_reference_and_do_not_depend_on_each_other(
    dtype, heads, kv_heads, dim, sinks
):
    g = torch.Generator().manual_seed(heads)
    dt = getattr(torch, dtype)
    q = torch.randn(len(LISTS), heads, dim, generator=g).to(dt)
    keys = (torch.randn(40, kv_heads, dim, generator=g) * 0.3).to(dt)
    values = torch.randn(40, kv_heads, dim, generator=g).to(dt)
    sink = torch.randn(heads, generator=g) if sinks else None
    lists = [torch.tensor(i, dtype=torch.int64) for i in LISTS]
    ours = attend_rows(q, keys, values, lists, dim**-0.5, sink)
    for r, i in enumerate(lists):
        alone = attend_rows(q[r : r + 1], keys, values, [i], dim**-0.5, sink)
        assert torch.equal(alone[0], ours[r]), r
        if not len(i):  # no key: only the sink (or nothing) in the softmax
            continue
        ref = attend_row(q[r], keys[i], values[i], dim**-0.5, sink).float()
        scale = values.float().abs().max()
        tolerance = 1e-5 if dtype == "float32" else 3e-2
        assert (ours[r].float() - ref).abs().max() <= tolerance * scale, r
