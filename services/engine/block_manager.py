"""The block pool: who holds which KV block, and which blocks hold a known prefix.

Every block is either referenced (ref_count > 0, held by one or more sequences) or free. A free
block may still carry the hash of the content it holds: it stays matchable by later prompts
until it is reused. Free blocks are reused least recently freed first, and a sequence frees
its blocks tail first, so a shared prefix outlives the suffixes that hang off it.

A model whose cache has groups released early (services/model/cache_spec.py) has a pool for
each (services/engine/group_pool.py): a block holds a block of each while some sequence may
still read that part. Allocation takes one of each for each new block; a
prefix-cache hit counts only as far as its last blocks still have theirs.

The pool is the one owner of this state; the scheduler and engine call its methods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvstore.block_hash import extend_hashes
from services.engine.group_pool import GroupPool
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
        self,
        num_blocks: int,
        block_size: int,
        namespace: str,
        enable_caching: bool = True,
        pools: Seq[GroupPool] = (),
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
        self.pools = tuple(pools)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have now (each with its groups' blocks)."""
        return min([len(self.free), *(p.available for p in self.pools)])

    @property
    def keeps_blocks_whole(self) -> bool:
        """Whether a block keeps every part until it is freed (no group lets go early): a
        finished sequence's blocks are whole; otherwise save blocks as they fill."""
        return not self.pools

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
            seq.block_hashes, seq.token_ids, self.block_size, self.namespace, seq.salt,
            seq.image_spans,
        )  # fmt: skip

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
        found = found[: self._usable(found)]
        self.queries += usable
        self.hits += len(found)
        self._reference(found)
        seq.block_ids = list(found)
        self._hold_prefix(seq, len(found))
        seq.num_computed_tokens = len(found) * self.block_size
        return seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Name seq's blocks that are full and computed by their content, so others match them."""
        if not self.enable_caching:
            return
        full = self._exact_blocks(seq)
        hashes = self.hashes(seq)
        for i in range(full):
            block = self.blocks[seq.block_ids[i]]
            if block.hash is not None:
                continue
            named = self.cached.get(hashes[i])
            if named is not None and self._whole(block.id) and not self._whole(named):
                self.blocks[named].hash = None  # the name goes to the copy with every part
                named = None
            if named is None:
                block.hash = hashes[i]
                self.cached[hashes[i]] = block.id
                self.cache_version += 1

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's blocks to hold `num_tokens` more computed tokens, or raise NoFreeBlocks
        having changed nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            raise NoFreeBlocks(f"need {need} blocks, {len(self.free)} free")
        for pool in self.pools:
            short = pool.shortfall(seq, need)
            if short:
                raise NoFreeBlocks(short)
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its content from the prefix cache
                del self.cached[block.hash]
                self.cache_version += 1
                block.hash = None
            block.ref_count = 1
            for pool in self.pools:
                pool.allocated(seq, len(seq.block_ids), block_id)
            seq.block_ids.append(block_id)

    def release(self, seq: Sequence) -> None:
        """Drop seq's references, tail first; it then holds no blocks and no computed KV."""
        for pool in self.pools:
            pool.released(seq, self._named(seq))
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
        for i in reversed(range(keep, len(seq.block_ids))):
            block_id = seq.block_ids[i]
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, "a rolled-back block is shared"
            for pool in self.pools:
                pool.truncated(seq, i, block_id)
            block.ref_count = 0
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)
        del seq.block_ids[keep:]

    # -- cache groups released early (group_pool.py) --------------------------------------

    def slide(self, seq: Sequence) -> None:
        """Let go of the parts of seq's blocks its next pass cannot read (called once its
        computed blocks are saved: a saved block carries every part)."""
        for pool in self.pools:
            pool.slide(seq, self._named(seq))

    def savable(self, block_id: int) -> bool:
        """Whether a block's every part is in the pool (a store value must be whole)."""
        return self._whole(block_id)

    def _exact_blocks(self, seq: Sequence) -> int:
        """seq's full computed blocks before any approximate KV (chunk_reuse.py)."""
        computed = seq.num_computed_tokens
        if seq.approximate_from is not None:
            computed = min(computed, seq.approximate_from)
        return computed // self.block_size

    def _whole(self, block_id: int) -> bool:
        return all(pool.has(block_id) for pool in self.pools)

    def _named(self, seq: Sequence) -> list[bool]:
        return [self.blocks[b].hash is not None for b in seq.block_ids]

    def _hold_prefix(self, seq: Sequence, prefix: int) -> None:
        for pool in self.pools:
            pool.hold_prefix(seq, prefix)

    def _usable(self, found: Seq[int], end: int | None = None) -> int:
        """How many of the cached blocks `found` a prefix can use (`end`: GroupPool.usable)."""
        return min((pool.usable(found, end) for pool in self.pools), default=len(found))

    def _reference(self, block_ids: Seq[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    # -- KV held outside the pool (services/engine/kv_connector.py) ----------------------

    def import_prefix(
        self, seq: Sequence, hashes: Seq[bytes], found: Seq[int] | None = None
    ) -> list[int]:
        """Give a sequence with no blocks one block per hash: cached ones (`found`, default
        the cache's lookup) are shared, the rest freshly allocated. Returns the indices (into
        `hashes`) whose KV the caller must write into `seq.block_ids[i]`, then call `commit`."""
        assert not seq.block_ids and seq.num_computed_tokens == 0
        hashes = list(hashes)
        found = list(self.lookup(hashes) if found is None else found)
        found = found[: self._usable(found, len(hashes))]  # a block lacking a part: fill anew
        fresh = len(hashes) - len(found)
        short = self._short(found, len(hashes))
        if short:
            raise NoFreeBlocks(short)
        self._reference(found)
        seq.block_ids = list(found)
        self._hold_prefix(seq, len(hashes))  # past `found`: allocate takes them
        seq.num_computed_tokens = len(found) * self.block_size
        self.allocate(seq, fresh * self.block_size)
        seq.num_computed_tokens = len(hashes) * self.block_size
        return list(range(len(found), len(hashes)))

    def _short(self, found: Seq[int], full: int, partial: bool = False) -> str:
        """Why a prefix of `full` blocks (`found` of them cached), and a partial one after it,
        does not fit ("" when it does)."""
        fresh = full - len(found) + partial
        available = len(self.free) - sum(self.blocks[b].ref_count == 0 for b in found)
        if fresh > available:
            return f"need {fresh} blocks, {available} free"
        return next((r for p in self.pools if (r := p.short(found, full, partial))), "")

    def admit_external(
        self, seq: Sequence, hashes: Seq[bytes], partial_tokens: int, skipped: int
    ) -> list[tuple[int, int]] | None:
        """Give `seq` (holding no blocks) a prefix held outside the pool: full blocks named by
        `hashes`, then `partial_tokens` more; blocks this pool caches are shared, the others
        allocated. Returns (index in the prefix, block id) for each block the caller must fill
        (before anything reads it: they are named now), or None, nothing changed, when the
        pool is short. At least one token is left to compute. The first `skipped` blocks have
        no values outside: where they are no longer cached (or the last ones lack a part),
        the prefix stops there."""
        usable = min(len(hashes) * self.block_size + partial_tokens, seq.num_tokens - 1)
        full = min(len(hashes), usable // self.block_size)
        partial = usable - full * self.block_size if full == len(hashes) else 0
        cached = self.lookup(hashes[:full])
        cached = cached[: self._usable(cached, full)]
        if len(cached) < skipped:
            full, partial = len(cached), 0
            full = self._usable(cached)
            cached = cached[:full]
        if self._short(cached, full, partial > 0):
            return None
        to_fill = self.import_prefix(seq, hashes[:full], cached)
        items = [(i, seq.block_ids[i]) for i in to_fill]
        if partial:
            self.allocate(seq, partial)
            items.append((full, seq.block_ids[-1]))
            seq.num_computed_tokens += partial
        self.commit(seq)
        seq.num_external_tokens = seq.num_computed_tokens - len(cached) * self.block_size
        return items

    def export(self, seq: Sequence) -> list[tuple[bytes, int]]:
        """(hash, block id) of each full, computed block of `seq` holding exact KV, in order."""
        full = self._exact_blocks(seq)
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
        for pool in self.pools:
            pool.check(set(self.cached.values()))

    def referenced_blocks(self) -> int:
        return self.num_blocks - len(self.free)  # every block is free or referenced (check())
