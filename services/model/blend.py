"""Rows of one prompt computed apart from their neighbours: what approximate KV reuse
(services/engine/chunk_reuse.py) runs on the paged cache.

A prompt whose chunks' K/V were placed in its slots from elsewhere is computed in full below a
layer `check`; from `check` on, only the rows a choice keeps are computed (the others keep the
K/V in their slots). The kept rows are scattered: each run of consecutive positions becomes a
span of its own over the sequence's one block table, attending to everything before it
(what the cache holds there, this pass's rows written first):

    positions:  p0 .......................... n
    kept:        x x . . . x . . x x x . . . x
    spans:      [p0, p0+2)   [.,.+1)  [.,.+3)  [.,.+1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from services.model.batch import ForwardBatch, SeqChunk

# (each row's values at layer `check` as computed now, and as its slot holds them, both
# [T, kv_heads, D]) -> the rows computed from `check` on: sorted offsets into the chunk
BlendChoice = Callable[[torch.Tensor, torch.Tensor], list[int]]


def runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted rows as runs [a, b) of consecutive ones."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def rows_batch(
    chunk: SeqChunk, rows: Sequence[int], block_size: int, device: torch.device
) -> ForwardBatch:
    """The chunk's `rows` (offsets into it, sorted) as a batch of one span per run, logits of
    the chunk's last row where it is kept and the chunk wants them."""
    last = len(chunk.token_ids)
    spans = [
        SeqChunk(
            chunk.token_ids[a:b],
            chunk.start + a,
            chunk.block_table,
            want_logits=chunk.want_logits and b == last,
            tables=chunk.tables,
        )
        for a, b in runs(rows)
    ]
    return ForwardBatch.build(spans, block_size, device)
