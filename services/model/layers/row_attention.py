"""Attention one query row at a time, over the keys that row sees: the torch reference of the
window-and-sink models (DeepSeek-V4, gpt-oss, Gemma 3). A row is computed alone, on tensors of
its own shape, so its bits never depend on the batch, the chunking or the other rows.

Transformers' eager arithmetic: logits in the model's dtype, times the scale; an optional
learned sink logit per head joins the softmax (float32) with no value; weights back in the
values' dtype."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from services.model import kv_cache
from services.model.batch import ForwardBatch


def attend_row(
    q: torch.Tensor,  # [heads, D]
    keys: torch.Tensor,  # [n, kv_heads, D]
    values: torch.Tensor,  # [n, kv_heads, Dv]
    scale: float,
    sinks: torch.Tensor | None = None,  # [heads], float32
) -> torch.Tensor:  # [heads, Dv]
    # contiguous: the products' kernels take another path (other bits) for other strides
    keys, values = keys.contiguous(), values.contiguous()
    heads, groups = q.shape[0], keys.shape[1]
    grouped = q.view(groups, heads // groups, q.shape[-1])  # query heads sharing a KV head
    logits = (grouped @ keys.permute(1, 2, 0)) * scale  # [kv_heads, group, n]
    logits = logits.reshape(heads, -1).float()
    if sinks is not None:
        logits = torch.cat((logits, sinks.float()[:, None]), dim=-1)
    probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)
    if sinks is not None:
        probs = probs[:, :-1]
    probs = probs.to(values.dtype).view(groups, heads // groups, -1)
    return (probs @ values.transpose(0, 1)).reshape(heads, -1)


def window_start(position: int, window: int | None) -> int:
    """The first position a query at `position` sees: itself and window - 1 before it."""
    return 0 if window is None else max(0, position - window + 1)


def attend_rows(
    q: torch.Tensor,  # [rows, heads, D]
    keys: torch.Tensor,  # [n, kv_heads, D]: every row's keys, in one buffer
    values: torch.Tensor,  # [n, kv_heads, Dv]
    lists: list[torch.Tensor],  # row r's keys: indices into keys / values (int64)
    scale: float,
    sinks: torch.Tensor | None = None,  # [heads], float32
) -> torch.Tensor:  # [rows, heads, Dv]
    """Every row over its own keys: kernels/row_attention.c on CPUs where it builds (float32
    and bfloat16), gpu/row_attention.py's Triton kernel on a GPU, else `attend_row` row by
    row. On the CPU either way a row's bits are its own."""
    if q.device.type == "cuda" and lists:
        from services.model.kernels.gpu.row_attention import attend_rows as triton_rows

        lengths = torch.tensor([0] + [len(i) for i in lists], dtype=torch.int64)
        index = torch.cat(lists).to(q.device, torch.int64)
        return triton_rows(q, keys, values, lengths.cumsum(0).to(q.device), index, scale, sinks)
    library = _library()
    dtypes = (torch.float32, torch.bfloat16)
    usable = library is not None and q.device.type == "cpu" and q.dtype in dtypes
    usable = usable and keys.dtype == values.dtype == q.dtype
    if not usable or not lists:
        each = [attend_row(q[r], keys[i], values[i], scale, sinks) for r, i in enumerate(lists)]
        return torch.stack(each) if each else q.new_empty(0, q.shape[1], values.shape[-1])
    assert library is not None
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    lengths = torch.tensor([0] + [len(i) for i in lists], dtype=torch.int64)
    starts, index = lengths.cumsum(0), torch.cat(lists).to(torch.int64).contiguous()
    rows, heads, _ = q.shape
    out = q.new_empty(rows, heads, values.shape[-1])
    sink = None if sinks is None else sinks.float().contiguous()
    status = library.rows_attend(
        q.data_ptr(), keys.data_ptr(), values.data_ptr(), int(q.dtype == torch.bfloat16),
        starts.data_ptr(), index.data_ptr(), None if sink is None else sink.data_ptr(),
        ctypes.c_float(scale), out.data_ptr(), rows, heads, keys.shape[1], q.shape[-1],
        values.shape[-1], int(lengths.max()),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("row attention: no scratch memory")
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    from services.model import kernels

    library = kernels.load("row_attention")
    if library is not None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        argtypes: list[Any] = [p, p, p, ctypes.c_int, p, p, p, ctypes.c_float, p] + [i64] * 6
        library.rows_attend.restype = ctypes.c_int
        library.rows_attend.argtypes = argtypes
    return library


def attend_paged(
    q: torch.Tensor,  # [T, heads, D]: the batch's rows
    k_cache: torch.Tensor,  # one layer of the paged pool (kv_cache.py)
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int | None = None,  # a sliding window (None: every earlier token)
    sinks: torch.Tensor | None = None,
    table: int | None = None,  # the layer's cache group's table in the batch (None: blocks')
) -> torch.Tensor:  # [T, heads, Dv]
    """Each row of the batch over its sequence's cached keys and values (its window of them:
    only the blocks the window covers are read); a row of an image whose rows attend both
    ways (SeqSpan.runs) over the image's later rows too."""
    keys, values, lists, base = [], [], [], 0
    bs = batch.block_size
    for span in batch.seqs:
        start = span.context_len - span.query_len
        first = window_start(start, window) // bs * bs  # the first token of the first block
        blocks = span.table(table)
        k, v = kv_cache.gather(k_cache, v_cache, blocks[first // bs :])
        keys.append(k[: span.context_len - first])
        values.append(v[: span.context_len - first])
        for t in range(start, span.context_len):
            end = span.row_end(t)  # t + 1, or past t where an image's rows see each other
            lists.append(torch.arange(base + window_start(t, window) - first, base + end - first))
        base += span.context_len - first
    return attend_rows(q, torch.cat(keys), torch.cat(values), lists, scale, sinks)
