"""The engine's one seam to KV held outside it, in two halves (vLLM's KV connector plays the
same part):

- the scheduler half, `KVConnector`, one per request (given with it: Engine.add_request):
  what its sequences bring at admission, which of their blocks leave and when, and whether a
  sequence is handed off (its generation goes on elsewhere) after a token;
- the worker half, `KVConnectorWorker`, one per engine (Engine's `kv_connector`): the bytes,
  loaded into the paged cache's blocks and saved out of them.

The engine knows these two protocols and nothing of prefill or decode workers or of stores:
prefill/connector.py and decode/connector.py are the scheduler halves of the two roles,
services/worker/kv_link.py the worker half for a KV store. A new kind of cache state is a
cache group (services/model/cache_spec.py), moved as part of every block; a new use of the
store is a new class on one side.

Every method runs on the engine's thread. Blocks handed to `save` belong to the sequence
until the call returns: the worker half copies what it needs before they can change hands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from services.engine.block_manager import BlockManager
from services.engine.request import Sequence
from services.model.kv_cache import KVCache


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
        cache.scatter([b for _, b in items], self.k[index], self.v[index])


@dataclass
class ImportedKV:
    """Leading blocks of a prompt read from outside: full ones, then maybe the partial one."""

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
class BlockToSave:
    index: int  # logical block index in the sequence
    block_id: int
    block_hash: bytes
    num_tokens: int  # block_size, or fewer for a partial block


class KVConnector(Protocol):
    """The scheduler half: one request's KV beyond the engine. It decides; it moves no bytes."""

    def prefix(self, seq: Sequence) -> ImportedKV | None:
        """The prefix `seq` brings at admission (the engine shares the blocks it caches and
        fills the others from it); None: nothing (the engine's prefix cache decides)."""
        ...

    def admitted(self, blocks: BlockManager, seq: Sequence) -> None:
        """`seq` now holds its prefix (`seq.num_computed_tokens` tokens)."""
        ...

    def computed(self, blocks: BlockManager, seq: Sequence) -> list[BlockToSave]:
        """A step computed (and committed) part of `seq`: the blocks to save now."""
        ...

    def hands_off(self, seq: Sequence) -> bool:
        """After the token just applied, `seq` stops here unfinished (its generation goes on
        elsewhere: FinishReason.HANDED_OFF) unless a stop or length ends it."""
        ...

    def finished(self, blocks: BlockManager, seq: Sequence) -> list[BlockToSave]:
        """`seq` finished (or was handed off); its blocks are still its own: those to save."""
        ...


class KVConnectorWorker(Protocol):
    """The worker half: moves KV between the engine's paged cache and outside."""

    def load(self, cache: KVCache, source: KVSource, items: list[tuple[int, int]]) -> None:
        """For each (index in `source`, block id): write that block into the cache."""
        ...

    def save(self, cache: KVCache, seq: Sequence, blocks: list[BlockToSave]) -> None:
        """Copy these blocks of `seq` out of the cache (before this returns) and send them."""
        ...


def full_blocks(blocks: BlockManager, seq: Sequence, start: int) -> list[BlockToSave]:
    """The full, computed blocks of `seq` from its `start`-th on (those whole in the pool: a
    block one of whose parts is let go is not saved)."""
    return [
        BlockToSave(i, block_id, block_hash, blocks.block_size)
        for i, (block_hash, block_id) in enumerate(blocks.export(seq))
        if i >= start and blocks.savable(block_id)
    ]
