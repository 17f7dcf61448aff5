"""Row attention in Triton (layers/row_attention.py's contract): each query row over its
own list of keys (a window, DeepSeek-V4's window plus compressed entries), an optional learned
sink per head in the softmax, one program per (row, head). The list is walked in tiles of
indices; an online softmax folds each tile in, starting from the sink (its logit, weight one,
no value). Scores, softmax and sums are float32. The torch reference is attend_row
(tests/services/model/test_triton_row_attention.py, under the interpreter on CPUs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def attend_rows(
    q: torch.Tensor,  # [rows, heads, D]
    keys: torch.Tensor,  # [n, kv_heads, D]
    values: torch.Tensor,  # [n, kv_heads, Dv]
    starts: torch.Tensor,  # [rows + 1] int64: row r's keys are index[starts[r]:starts[r + 1]]
    index: torch.Tensor,  # [nnz] int64
    scale: float,
    sinks: torch.Tensor | None = None,  # [heads]
) -> torch.Tensor:  # [rows, heads, Dv] in q's dtype
    rows, heads, dim = q.shape
    kv_heads, dv = keys.shape[1], values.shape[-1]
    out = torch.empty(rows, heads, dv, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out.to(q.dtype)
    sink = torch.zeros(heads, device=q.device) if sinks is None else sinks.float()
    _attend[(rows, heads)](
        q.contiguous(), keys.contiguous(), values.contiguous(), starts, index, sink.contiguous(),
        out, heads, heads // kv_heads, kv_heads, dim, dv, scale, HAS_SINK=sinks is not None,
        BLOCK_N=16, BLOCK_D=triton.next_power_of_2(dim), BLOCK_DV=triton.next_power_of_2(dv),
    )  # fmt: skip
    return out.to(q.dtype)


@triton.jit
def _attend(
    q,
    keys,
    values,
    starts,
    index,
    sinks,
    out,
    H,
    GROUP,
    KVH,
    D,
    DV,
    scale,
    HAS_SINK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    g = head // GROUP
    d = tl.arange(0, BLOCK_D)
    c = tl.arange(0, BLOCK_DV)
    j = tl.arange(0, BLOCK_N)
    query = tl.load(q + (row * H + head) * D + d, mask=d < D, other=0.0).to(tl.float32)
    first = tl.load(starts + row)
    n = tl.load(starts + row + 1) - first
    if HAS_SINK:
        top = tl.load(sinks + head)
        total = 1.0  # the sink's own weight, e^(sink - top)
    else:
        top = -float("inf")
        total = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for tile in range(0, tl.cdiv(n, BLOCK_N)):
        seen = tile * BLOCK_N + j < n
        idx = tl.load(index + first + tile * BLOCK_N + j, mask=seen, other=0)
        at = (idx * KVH + g)[:, None]
        k = tl.load(keys + at * D + d[None, :], mask=seen[:, None] & (d[None, :] < D), other=0.0)
        s = tl.sum(k.to(tl.float32) * query[None, :], axis=1) * scale  # [BLOCK_N]
        s = tl.where(seen, s, -float("inf"))
        new_top = tl.maximum(top, tl.max(s, axis=0))
        rescale = tl.exp(top - new_top)
        p = tl.where(seen, tl.exp(s - new_top), 0.0)
        v = tl.load(
            values + at * DV + c[None, :], mask=seen[:, None] & (c[None, :] < DV), other=0.0
        )
        total = total * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(v.to(tl.float32) * p[:, None], axis=0)
        top = new_top
    tl.store(out + (row * H + head) * DV + c, acc / total, mask=c < DV)
