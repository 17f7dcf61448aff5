"""Attention one query row at a time, over the keys that row sees: the torch reference of the
window-and-sink models (DeepSeek-V4, gpt-oss, Gemma 3). A row is computed alone, on tensors of
its own shape, so its bits never depend on the batch, the chunking or the other rows.

Transformers' eager arithmetic: logits in the model's dtype, times the scale; an optional
learned sink logit per head joins the softmax (float32) with no value; weights back in the
values' dtype."""

from __future__ import annotations

import torch


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
