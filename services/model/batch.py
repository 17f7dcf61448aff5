"""The input of one forward pass: a flattened batch of prefill chunks and decode tokens.

    tokens:   | seq A: prefill chunk (5) | B: decode (1) | C: prefill chunk (3) |
    rows:       0 1 2 3 4                  5               6 7 8
    positions:  0 1 2 3 4                  37              16 17 18

Each row's K/V is written to `slot_mapping[row]` (block * block_size + offset) through the
sequence's block table; each sequence then attends over its first `context_len` tokens. A cache
group with blocks of its own (kv_cache.py) has a table of its own for each sequence, and its
slots through it (`tables`, `slots(index)`).

An image's rows (ImageRows) replace its placeholders' token embeddings (`embeds` at
`embed_rows`); where they attend both ways (Gemma 3), a row of the image sees every position of
it (`SeqSpan.runs`), so a chunk holding any of an image's rows holds its last one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageRows:
    """An image's embeddings in a sequence: they take the place of the token embeddings of
    positions [start, end)."""

    start: int
    embeds: torch.Tensor  # [length, hidden]
    both_ways: bool = False  # its positions attend to one another both ways

    @property
    def end(self) -> int:
        return self.start + int(self.embeds.shape[0])


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence in this pass, and where its KV lives."""

    token_ids: Sequence[int]
    start: int  # position of token_ids[0]: how many tokens are already in the cache
    block_table: Sequence[int]  # physical block of each logical block, covering start + len
    want_logits: bool = True  # logits of the chunk's last token (false mid-prefill)
    all_logits: bool = False  # logits of every token of the chunk (scoring a prompt)
    # each cache group with blocks of its own: the group's block for each block (-1: let go,
    # never read again); none given: the block table is every group's
    tables: tuple[Sequence[int], ...] = ()
    images: tuple[ImageRows, ...] = ()  # the sequence's images (those the chunk touches count)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)

    def image_rows(self) -> list[tuple[int, ImageRows, int, int]]:
        """(the chunk's first row it covers, image, first, end) for each image's part in the
        chunk: image rows [first, end) of positions start + first..."""
        out = []
        for image in self.images:
            a, b = max(image.start, self.start), min(image.end, self.context_len)
            if a < b:
                if image.both_ways and image.end > self.context_len:
                    raise ValueError(f"a chunk ends inside the image at {image.start}")
                out.append((a - self.start, image, a - image.start, b - image.start))
        return out


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's rows in the flattened batch."""

    row: int  # first row of this sequence
    query_len: int
    context_len: int  # tokens attended to, new ones included
    block_table: torch.Tensor  # [num_blocks] int64
    tables: tuple[torch.Tensor, ...] = ()  # [num_blocks] int64 each (SeqChunk.tables)
    # positions [a, b) whose rows attend to each other both ways (an image, in Gemma 3)
    runs: tuple[tuple[int, int], ...] = ()

    def row_end(self, position: int) -> int:
        """One past the last position the row at `position` attends to."""
        for a, b in self.runs:
            if a <= position < b:
                return b
        return position + 1

    def table(self, index: int | None) -> torch.Tensor:
        """The table of the cache group at `index` among those with blocks of their own (the
        block table for a group without, or where the batch names none)."""
        return self.block_table if index is None or not self.tables else self.tables[index]

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
    # the same spans as tensors, one row per sequence, for kernels that take them whole
    block_tables: torch.Tensor  # [S, max blocks] int64, padded with block 0
    seq_rows: torch.Tensor  # [S] int64: first row of each sequence
    query_lens: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S] int64
    max_query_len: int
    max_context_len: int
    group_slots: tuple[torch.Tensor, ...] = ()  # [T] each: a row's slot in a group's pool
    # images' rows (ImageRows): embeds [E, hidden] in place of rows embed_rows [E] int64
    embeds: torch.Tensor | None = None
    embed_rows: torch.Tensor | None = None

    def slots(self, index: int | None) -> torch.Tensor:
        """Where each row's K/V goes in the cache group at `index` among those with blocks of
        their own (slot_mapping for a group without, or where the batch names none)."""
        return (
            self.slot_mapping if index is None or not self.group_slots else self.group_slots[index]
        )

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
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        embed_rows: list[int] = []
        runs: list[tuple[tuple[int, int], ...]] = []
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("a chunk must carry at least one token")
            needed = -(-c.context_len // block_size)
            if len(c.block_table) < needed:
                raise ValueError(f"block table of {len(c.block_table)} blocks, need {needed}")
            row = len(tokens)
            rows.append(row)
            tokens.extend(c.token_ids)
            span = range(c.start, c.context_len)
            positions.extend(span)
            slots.extend(c.block_table[p // block_size] * block_size + p % block_size for p in span)
            tables.append(list(c.block_table[:needed]))
            if c.all_logits:
                logits_rows.extend(range(row, row + n))
            elif c.want_logits:
                logits_rows.append(row + n - 1)
            parts = c.image_rows()
            for first_row, image, first, end in parts:
                embeds.append(image.embeds[first:end])
                embed_rows.extend(range(row + first_row, row + first_row + end - first))
            runs.append(tuple((i.start, i.end) for _, i, _, _ in parts if i.both_ways))
        width = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        qlens = [len(c.token_ids) for c in chunks]
        lens = [c.context_len for c in chunks]
        # one host buffer, one copy to the device (pinned, asynchronous, on a GPU)
        flat = [*tokens, *positions, *slots, *logits_rows, *rows, *qlens, *lens]
        staged = torch.tensor(flat + [x for t in padded for x in t], dtype=torch.int64)
        if device is not None:
            staged = on_device(staged, torch.device(device))
        parts = staged.split([len(tokens), len(positions), len(slots), len(logits_rows),
                              len(rows), len(qlens), len(lens), len(padded) * width])  # fmt: skip
        token_t, position_t, slot_t, logits_t, row_t, qlen_t, len_t, table_t = parts
        table_t = table_t.view(len(padded), width)
        spans = tuple(
            SeqSpan(row, n, length, table_t[i, : len(t)], runs=r)
            for i, (row, n, length, t, r) in enumerate(
                zip(rows, qlens, lens, tables, runs, strict=True)
            )
        )
        group_slots: tuple[torch.Tensor, ...] = ()
        if any(c.tables for c in chunks):
            spans, group_slots = _group_tables(chunks, spans, block_size, position_t.device)
        embed_t = embed_row_t = None
        if embeds:
            embed_t = torch.cat(embeds).to(position_t.device)
            embed_row_t = torch.tensor(embed_rows, dtype=torch.int64, device=position_t.device)
        return cls(
            token_t, position_t, slot_t, spans, logits_t, block_size, table_t, row_t, qlen_t,
            len_t, max(qlens, default=0), max(lens, default=0), group_slots, embed_t,
            embed_row_t,
        )  # fmt: skip

    def to_wire(self) -> torch.Tensor:
        """The batch as one int64 tensor on its device, for another process to rebuild
        (from_wire): the sizes, then every field, flat; then, with cache groups of their own,
        each group's row slots and each sequence's table in it (padded as block_tables)."""
        if self.embeds is not None:
            raise ValueError("a batch with images does not go to other ranks")
        groups = len(self.group_slots)
        width = self.block_tables.shape[1]
        sizes = [self.num_tokens, len(self.logits_rows), len(self.seqs), width,
                 self.block_size, groups]  # fmt: skip
        fields = (self.token_ids, self.positions, self.slot_mapping, self.logits_rows,
                  self.seq_rows, self.query_lens, self.context_lens)  # fmt: skip
        head = torch.tensor(sizes, dtype=torch.int64, device=self.token_ids.device)
        tables = [
            torch.nn.functional.pad(span.tables[g], (0, width - len(span.tables[g])))
            for g in range(groups)
            for span in self.seqs
        ]
        return torch.cat([head, *fields, self.block_tables.flatten(), *self.group_slots, *tables])

    @classmethod
    def from_wire(cls, wire: torch.Tensor) -> ForwardBatch:
        """The batch `to_wire` gave, its tensors views of `wire` (on wire's device)."""
        tokens, logits, seqs, width, block_size, groups = wire[:WIRE_SIZES].tolist()
        parts = wire[WIRE_SIZES:].split([tokens, tokens, tokens, logits, seqs, seqs, seqs,
                                         seqs * width, groups * tokens,
                                         groups * seqs * width])  # fmt: skip
        token_t, position_t, slot_t, logits_t, row_t, qlen_t, len_t, table_t, gs, gt = parts
        table_t = table_t.view(seqs, width)
        group_tables = gt.view(groups, seqs, width)
        rows, qlens, lens = row_t.tolist(), qlen_t.tolist(), len_t.tolist()
        spans = []
        for i, (row, n, length) in enumerate(zip(rows, qlens, lens, strict=True)):
            used = -(-length // block_size)
            own = tuple(group_tables[g, i, :used] for g in range(groups))
            spans.append(SeqSpan(row, n, length, table_t[i, :used], own))
        return cls(
            token_t, position_t, slot_t, tuple(spans), logits_t, block_size, table_t, row_t,
            qlen_t, len_t, max(qlens, default=0), max(lens, default=0),
            tuple(gs.view(groups, tokens)),
        )  # fmt: skip


WIRE_SIZES = 6  # the int64s heading a batch's wire form: its sizes


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device; to a GPU from pinned memory, without waiting: a copy from
    pageable memory waits for the work queued before it (with async scheduling, the forward
    pass the host is meant to run ahead of)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _group_tables(
    chunks: Sequence[SeqChunk], spans: tuple[SeqSpan, ...], block_size: int, device: torch.device
) -> tuple[tuple[SeqSpan, ...], tuple[torch.Tensor, ...]]:
    """The spans with their groups' tables, and each row's slot in each group's pool."""
    groups = max(len(c.tables) for c in chunks)
    out: list[SeqSpan] = []
    slots: list[list[int]] = [[] for _ in range(groups)]
    for c, span in zip(chunks, spans, strict=True):
        tables = []
        for g in range(groups):
            table = list(c.tables[g] if c.tables else c.block_table)[: len(span.block_table)]
            for p in range(c.start, c.context_len):
                block = table[p // block_size]
                if block < 0:
                    raise ValueError(f"the part of position {p} in cache group {g} is let go")
                slots[g].append(block * block_size + p % block_size)
            tables.append(torch.tensor(table, dtype=torch.int64, device=device))
        out.append(
            SeqSpan(
                span.row,
                span.query_len,
                span.context_len,
                span.block_table,
                tuple(tables),
                span.runs,
            )
        )
    return tuple(out), tuple(torch.tensor(g, dtype=torch.int64, device=device) for g in slots)
