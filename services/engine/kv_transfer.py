"""The engine's one seam to disaggregation: a request's `KVTransfer`, which decides what its
sequences bring at admission, what leaves as their blocks are computed, and what happens when
they finish. The engine knows nothing else of prefill or decode workers; their two
implementations are prefill/transfer.py and decode/transfer.py, both built on `StoreTransfer`
below (vLLM's KV connector plays the same part).

In: a worker fetches a request's prompt blocks before the engine admits it (`ImportedKV`).
At admission the sequence shares the blocks the engine already caches, fills fresh ones from
the import, and computes whatever the import lacks.

Out: blocks that are full and computed (and a prompt's partial last block, once the prompt is
done) go to an exporter callback, from the engine's own thread, right after the step that
computed them (a prefill) or when the sequence finishes (a decode's write-back): the callback
copies what it needs before the blocks can change hands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from services.engine.block_manager import BlockManager
from services.engine.request import Sequence
from services.model.kv_cache import KVCache, scatter_blocks


class KVSource(Protocol):
    """Blocks of KV held outside the cache (fetched values, tensors), written into cache
    blocks on request: the only copy they make is into the cache."""

    def write(self, cache: KVCache, items: list[tuple[int, int]]) -> None:
        """For each (index in this source, block id): write that block's K/V, all layers."""
        ...


@dataclass(frozen=True)
class TensorKV:
    """A KVSource of block tensors, as `gather_blocks` returns them."""

    k: torch.Tensor  # [n, layers, kv_heads, D, bs]
    v: torch.Tensor  # [n, layers, kv_heads, bs, D]

    def write(self, cache: KVCache, items: list[tuple[int, int]]) -> None:
        index = [i for i, _ in items]
        scatter_blocks(cache, [b for _, b in items], self.k[index], self.v[index])


@dataclass
class ImportedKV:
    """Leading blocks of a prompt read from a store: full ones, then maybe the partial one."""

    hashes: list[bytes]  # of the full blocks
    source: KVSource  # the full blocks' KV, then the partial block's (if any)
    block_size: int
    partial_tokens: int = 0  # tokens in the trailing partial block, 0 if none
    # Leading blocks not fetched because the cache held them when the worker looked: the
    # source has no values for them. Evicted since, the import stops where the cache does.
    skipped: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size + self.partial_tokens


@dataclass(frozen=True)
class BlockToExport:
    index: int  # logical block index in the sequence
    block_id: int
    block_hash: bytes
    num_tokens: int  # block_size, or fewer for a partial block


Exporter = Callable[[Sequence, list[BlockToExport]], None]


class KVTransfer(Protocol):
    """A request's KV beyond the engine; every method runs on the engine's thread."""

    # the sequence finishes at its first token (FinishReason.PREFILLED): decode goes on elsewhere
    finishes_at_first_token: bool

    def admit(self, blocks: BlockManager, cache: KVCache, seq: Sequence) -> int | None:
        """Give `seq` (holding no blocks) the prefix it brings: the tokens now computed (0:
        not yet, the pool is short), or None when it brings nothing (the engine's prefix
        cache decides)."""
        ...

    def computed(self, blocks: BlockManager, seq: Sequence) -> None:
        """A step computed (and committed) part of `seq`."""
        ...

    def finished(self, blocks: BlockManager, seq: Sequence) -> None:
        """`seq` finished; its blocks are still its own."""
        ...


class StoreTransfer:
    """A KVTransfer to and from a KV store: the import (for choice 0; the other choices share
    its blocks through the prefix cache), and blocks out to `exporter` when a subclass says.
    Remembers, per choice, the leading blocks already sent or already in the store."""

    finishes_at_first_token = False

    def __init__(self, imported: ImportedKV | None, exporter: Exporter | None) -> None:
        self.imported = imported
        self.exporter = exporter
        self.exported: dict[int, int] = {}  # choice -> leading blocks sent or in the store

    def admit(self, blocks: BlockManager, cache: KVCache, seq: Sequence) -> int | None:
        if self.imported is None or seq.index != 0:
            return None
        computed = admit_import(blocks, cache, seq, self.imported)
        if computed:
            self.exported[seq.index] = computed // blocks.block_size  # in the store already
            self.imported = None
        return computed

    def computed(self, blocks: BlockManager, seq: Sequence) -> None:
        pass

    def finished(self, blocks: BlockManager, seq: Sequence) -> None:
        pass

    def export(
        self, blocks: BlockManager, seq: Sequence, partial_hash: bytes | None = None
    ) -> None:
        """Send the blocks of `seq` that became full since the last call, and with
        `partial_hash` (its hash) the prompt's partial last block once the prompt is computed."""
        if self.exporter is None:
            return
        done = self.exported.get(seq.index, 0)
        ready, self.exported[seq.index] = blocks_to_export(blocks, seq, done, partial_hash)
        if ready:
            self.exporter(seq, ready)


def admit_import(blocks: BlockManager, cache: KVCache, seq: Sequence, kv: ImportedKV) -> int:
    """Give `seq` (holding no blocks) its imported prefix: cached blocks shared, the others
    written from the import. Returns the tokens now computed; 0 (nothing changed) when the
    pool cannot supply the blocks yet. At least one token is left to compute. Sets
    `seq.store_tokens` to the tokens written from the import."""
    usable = min(kv.num_tokens, seq.num_tokens - 1)
    full = min(len(kv.hashes), usable // blocks.block_size)
    partial = usable - full * blocks.block_size if full == len(kv.hashes) else 0
    cached = blocks.lookup(kv.hashes[:full])
    if len(cached) < kv.skipped:  # evicted since the worker looked: no values for the gap
        full, partial = len(cached), 0
    fresh = full - len(cached) + (1 if partial else 0)
    if fresh > blocks.num_free - sum(blocks.blocks[b].ref_count == 0 for b in cached):
        return 0
    to_fill = blocks.import_prefix(seq, kv.hashes[:full])
    items = [(i, seq.block_ids[i]) for i in to_fill]
    if partial:
        blocks.allocate(seq, partial)
        items.append((full, seq.block_ids[-1]))
        seq.num_computed_tokens += partial
    if items:
        kv.source.write(cache, items)
    blocks.commit(seq)
    seq.store_tokens = seq.num_computed_tokens - len(cached) * blocks.block_size
    return seq.num_computed_tokens


def blocks_to_export(
    blocks: BlockManager, seq: Sequence, done: int, partial_hash: bytes | None
) -> tuple[list[BlockToExport], int]:
    """The full blocks of `seq` past its first `done` (and, with `partial_hash`, the prompt's
    partial last block once the prompt is computed), and the count of leading blocks now sent."""
    bs = blocks.block_size
    full = seq.num_computed_tokens // bs
    hashes = blocks.hashes(seq)
    out = [BlockToExport(i, seq.block_ids[i], hashes[i], bs) for i in range(done, full)]
    rest = seq.prompt_len - full * bs
    if partial_hash is not None and 0 < rest < bs and seq.num_computed_tokens >= seq.prompt_len:
        out.append(BlockToExport(full, seq.block_ids[full], partial_hash, rest))
    return out, max(done, full)
