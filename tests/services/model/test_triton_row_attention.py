"""The Triton row attention (kernels/gpu/row_attention.py) against the torch reference
(row_attention.attend_row): rows with windows, scattered entries and sinks, grouped heads, in
float32 and bfloat16. On this CPU the kernel runs in Triton's interpreter (small sizes)."""

from __future__ import annotations

import pytest
import torch

from services.model.kernels import gpu
from services.model.layers.row_attention import attend_row
from tests.support.devices import test_device

DEVICE = test_device()

pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not gpu.interpreted(),
    reason="torch sees a GPU: run these with PDSERVE_TEST_DEVICE=cuda",
)
LISTS = [[0, 1, 2], list(range(5, 40)), [1, 7, 30], [0], list(range(10, 27))]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (2, 1, 24)])
@pytest.mark.parametrize("sinks", [False, True])
def test_triton_row_attention_equals_the_torch_reference(dtype, tol, heads, kv_heads, dim, sinks):
    from services.model.kernels.gpu.row_attention import attend_rows

    g = torch.Generator().manual_seed(heads + dim)
    q = torch.randn(len(LISTS), heads, dim, generator=g).to(dtype)
    keys = (torch.randn(40, kv_heads, dim, generator=g) * 0.3).to(dtype)
    values = torch.randn(40, kv_heads, dim, generator=g).to(dtype)
    sink = torch.randn(heads, generator=g) if sinks else None
    lists = [torch.tensor(i, dtype=torch.int64) for i in LISTS]
    starts = torch.tensor([0] + [len(i) for i in LISTS]).cumsum(0)
    on = {"device": DEVICE}
    ours = attend_rows(
        q.to(**on),
        keys.to(**on),
        values.to(**on),
        starts.to(**on),
        torch.cat(lists).to(**on),
        dim**-0.5,
        None if sink is None else sink.to(**on),
    ).cpu()
    ref = torch.stack(
        [attend_row(q[r], keys[i], values[i], dim**-0.5, sink) for r, i in enumerate(lists)]
    )
    scale = values.float().abs().max()
    assert (ours.float() - ref.float()).abs().max() <= tol * scale
