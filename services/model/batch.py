"""The input of one forward pass: a flattened batch of prefill chunks and decode tokens.

    tokens:   | seq A: prefill chunk (5) | B: decode (1) | C: prefill chunk (3) |
    rows:       0 1 2 3 4                  5               6 7 8
    positions:  0 1 2 3 4                  37              16 17 18

Each row's K/V is written to `slot_mapping[row]` (block * block_size + offset) through the
sequence's block table; each sequence then attends over its first `context_len` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence in this pass, and where its KV lives."""

    token_ids: Sequence[int]
    start: int  # position of token_ids[0]: how many tokens are already in the cache
    block_table: Sequence[int]  # physical block of each logical block, covering start + len
    want_logits: bool = True  # logits of the chunk's last token (false mid-prefill)
    all_logits: bool = False  # logits of every token of the chunk (scoring a prompt)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's rows in the flattened batch."""

    row: int  # first row of this sequence
    query_len: int
    context_len: int  # tokens attended to, new ones included
    block_table: torch.Tensor  # [num_blocks] int64

    @property
    def is_decode(self) -> bool:
        return self.query_len == 1


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    seqs: tuple[SeqSpan, ...]
    logits_rows: torch.Tensor  # [L] int64: rows whose logits the pass returns, in order
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def build(
        cls, chunks: Sequence[SeqChunk], block_size: int, device: torch.device | None = None
    ) -> ForwardBatch:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        logits_rows: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("a chunk must carry at least one token")
            needed = -(-c.context_len // block_size)
            if len(c.block_table) < needed:
                raise ValueError(f"block table of {len(c.block_table)} blocks, need {needed}")
            row = len(tokens)
            tokens.extend(c.token_ids)
            span = range(c.start, c.context_len)
            positions.extend(span)
            slots.extend(c.block_table[p // block_size] * block_size + p % block_size for p in span)
            table = torch.tensor(list(c.block_table[:needed]), dtype=torch.int64, device=device)
            spans.append(SeqSpan(row, n, c.context_len, table))
            if c.all_logits:
                logits_rows.extend(range(row, row + n))
            elif c.want_logits:
                logits_rows.append(row + n - 1)

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(t(tokens), t(positions), t(slots), tuple(spans), t(logits_rows), block_size)
