"""KV computed elsewhere coming in, and KV computed here going out: the engine's seam to a
KV store, which stays outside the engine (workers wire it up).

In: a decode worker fetches a request's prompt blocks before the engine admits it and
attaches them as `ImportedKV`. At admission the engine shares the blocks it already caches,
fills fresh ones from the import, and computes whatever the import lacks.

Out: for a sequence marked for export, the engine reports each block once it is full and
computed (and, for a prefill, the partial last block of the prompt when the prompt is done)
to an exporter callback, from the engine's own thread, right after the step that computed
it: the callback copies what it needs before the blocks can change hands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.block_hash import block_hashes
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
    blocks: BlockManager, seq: Sequence, partial_hash: bytes | None
) -> list[BlockToExport]:
    """The blocks of `seq` that became full (or, with `partial_hash`, the prompt's partial last
    block) since the last call; marks them exported."""
    bs = blocks.block_size
    full = seq.num_computed_tokens // bs
    hashes = blocks.hashes(seq)
    out = [
        BlockToExport(i, seq.block_ids[i], hashes[i], bs) for i in range(seq.exported_blocks, full)
    ]
    seq.exported_blocks = max(seq.exported_blocks, full)
    rest = seq.prompt_len - full * bs
    if partial_hash is not None and 0 < rest < bs and seq.num_computed_tokens >= seq.prompt_len:
        out.append(BlockToExport(full, seq.block_ids[full], partial_hash, rest))
    return out


def partial_block_hash(blocks: BlockManager, seq: Sequence) -> bytes | None:
    """The hash of the prompt's partial last block (DESIGN.md), None if the prompt fills its
    blocks exactly."""
    prompt = seq.token_ids[: seq.prompt_len]
    if len(prompt) % blocks.block_size == 0:
        return None
    return block_hashes(prompt, blocks.block_size, blocks.namespace, seq.salt, True)[-1]
