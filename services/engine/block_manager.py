"""The block pool: who holds which KV block, and which blocks hold a known prefix.

Every block is either referenced (ref_count > 0, held by one or more sequences) or free. A free
block may still carry the hash of the content it holds: it stays matchable by later prompts
until it is reused. Free blocks are reused least recently freed first, and a sequence frees
its blocks tail first, so a shared prefix outlives the suffixes that hang off it.

The pool is the one owner of this state; the scheduler and engine call its methods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvstore.block_hash import extend_hashes
from services.engine.request import Sequence


class NoFreeBlocks(Exception):
    """Raised by `allocate` when the pool cannot supply the blocks asked for."""


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and computed


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, namespace: str, enable_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.namespace = namespace
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # content hash -> block holding it
        self.cache_version = 0  # counts changes to `cached` (AsyncEngine's snapshot of it)
        self.hits = 0  # prefix-cache lookups, in blocks
        self.queries = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to hold `num_tokens` more computed tokens."""
        total = -(-(seq.num_computed_tokens + num_tokens) // self.block_size)
        return max(0, total - len(seq.block_ids))

    # -- prefix cache --------------------------------------------------------------------

    def hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of seq's full blocks (computed or not), extended as tokens arrive."""
        return extend_hashes(
            seq.block_hashes, seq.token_ids, self.block_size, self.namespace, seq.salt
        )

    def lookup(self, hashes: Seq[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (none with caching off).
        Takes no reference and changes nothing: workers call it from their own threads."""
        found: list[int] = []
        if not self.enable_caching:
            return found
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def admit(self, seq: Sequence) -> int:
        """Attach the cached prefix of a sequence that holds no blocks; returns its length in
        tokens. At least one token is left to compute: its logits are needed."""
        assert not seq.block_ids and seq.num_computed_tokens == 0
        if not self.enable_caching:
            return 0
        hashes = self.hashes(seq)
        usable = (seq.num_tokens - 1) // self.block_size
        found = self.lookup(hashes[:usable])
        self.queries += usable
        self.hits += len(found)
        self._reference(found)
        seq.block_ids = list(found)
        seq.num_computed_tokens = len(found) * self.block_size
        return seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Name seq's blocks that are full and computed by their content, so others match them."""
        if not self.enable_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        hashes = self.hashes(seq)
        for i in range(full):
            block = self.blocks[seq.block_ids[i]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                self.cached[hashes[i]] = block.id
                self.cache_version += 1

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's blocks to hold `num_tokens` more computed tokens, or raise NoFreeBlocks
        having changed nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise NoFreeBlocks(f"need {need} blocks, {self.num_free} free")
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its content from the prefix cache
                del self.cached[block.hash]
                self.cache_version += 1
                block.hash = None
            block.ref_count = 1
            seq.block_ids.append(block_id)

    def release(self, seq: Sequence) -> None:
        """Drop seq's references, tail first; it then holds no blocks and no computed KV."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:  # a named block stays matchable until reused
                self.free[block_id] = None
        seq.block_ids = []
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Release seq's blocks past its first `num_tokens` (default: its computed tokens):
        speculated tokens rejected, or slots reserved for proposals not made. They were never
        full and committed, so they hold nothing matchable: reused first."""
        keep = -(
            -(seq.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size
        )
        for block_id in reversed(seq.block_ids[keep:]):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, "a rolled-back block is shared"
            block.ref_count = 0
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)
        del seq.block_ids[keep:]

    def _reference(self, block_ids: Seq[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    # -- KV held outside the pool (services/engine/kv_connector.py) ----------------------

    def import_prefix(self, seq: Sequence, hashes: Seq[bytes]) -> list[int]:
        """Give a sequence with no blocks one block per hash: cached ones are shared, the rest
        freshly allocated. Returns the indices (into `hashes`) whose KV the caller must write
        into `seq.block_ids[i]`, then call `commit`."""
        assert not seq.block_ids and seq.num_computed_tokens == 0
        hashes = list(hashes)
        found = self.lookup(hashes)
        fresh = len(hashes) - len(found)
        available = self.num_free - sum(self.blocks[b].ref_count == 0 for b in found)
        if fresh > available:
            raise NoFreeBlocks(f"need {fresh} blocks, {available} free")
        self._reference(found)
        seq.block_ids = list(found)
        seq.num_computed_tokens = len(found) * self.block_size
        self.allocate(seq, fresh * self.block_size)
        seq.num_computed_tokens = len(hashes) * self.block_size
        return list(range(len(found), len(hashes)))

    def admit_external(
        self, seq: Sequence, hashes: Seq[bytes], partial_tokens: int, skipped: int
    ) -> list[tuple[int, int]] | None:
        """Give `seq` (holding no blocks) a prefix held outside the pool: full blocks named by
        `hashes`, then `partial_tokens` more; blocks this pool caches are shared, the others
        allocated. Returns (index in the prefix, block id) for each block the caller must fill
        (before anything reads it: they are named now), or None, nothing changed, when the
        pool is short. At least one token is left to compute. The first `skipped` blocks have
        no values outside: where they are no longer cached, the prefix stops there."""
        usable = min(len(hashes) * self.block_size + partial_tokens, seq.num_tokens - 1)
        full = min(len(hashes), usable // self.block_size)
        partial = usable - full * self.block_size if full == len(hashes) else 0
        cached = self.lookup(hashes[:full])
        if len(cached) < skipped:
            full, partial = len(cached), 0
        fresh = full - len(cached) + (1 if partial else 0)
        if fresh > self.num_free - sum(self.blocks[b].ref_count == 0 for b in cached):
            return None
        to_fill = self.import_prefix(seq, hashes[:full])
        items = [(i, seq.block_ids[i]) for i in to_fill]
        if partial:
            self.allocate(seq, partial)
            items.append((full, seq.block_ids[-1]))
            seq.num_computed_tokens += partial
        self.commit(seq)
        seq.num_external_tokens = seq.num_computed_tokens - len(cached) * self.block_size
        return items

    def export(self, seq: Sequence) -> list[tuple[bytes, int]]:
        """(hash, block id) of each full, computed block of `seq`, in order."""
        full = seq.num_computed_tokens // self.block_size
        return list(zip(self.hashes(seq)[:full], seq.block_ids[:full], strict=True))

    # -- invariants ----------------------------------------------------------------------

    def check(self) -> None:
        """Assert the pool's invariants; tests call this after every scenario."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert len(used) + len(self.free) == self.num_blocks, "free + used != total"
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref_count"
        assert not any(self.blocks[i].ref_count for i in self.free), "a free block is referenced"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h, f"cache entry for block {block_id} is stale"
        named = sum(b.hash is not None for b in self.blocks)
        assert named == len(self.cached), "a block carries a hash the cache does not know"

    def referenced_blocks(self) -> int:
        return self.num_blocks - self.num_free  # every block is free or referenced (check())
