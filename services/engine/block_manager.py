"""The block pool: who holds which KV block, and which blocks hold a known prefix.

Every block is either referenced (ref_count > 0, held by one or more sequences) or free. A free
block may still carry the hash of the content it holds: it stays matchable by later prompts
until it is reused. Free blocks are reused least recently freed first, and a sequence frees
its blocks tail first, so a shared prefix outlives the suffixes that hang off it.

A model with a window part (DeepSeek-V4) has a second pool, of window blocks
(services/engine/window_pool.py): a block holds one while some sequence may still read its
window part. Allocation takes a window block for each new block; a prefix-cache hit counts only
as far as its last blocks still have theirs.

The pool is the one owner of this state; the scheduler and engine call its methods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvstore.block_hash import extend_hashes
from services.engine.request import Sequence
from services.engine.window_pool import WindowPool


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
        windows: WindowPool | None = None,
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
        self.windows = windows

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have now (each with its window block, where there are)."""
        if self.windows is not None:
            return min(len(self.free), self.windows.available)
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
        if self.windows is not None:
            found = found[: self._windowed(found)]
        self.queries += usable
        self.hits += len(found)
        self._reference(found)
        seq.block_ids = list(found)
        self._hold_windows(seq, len(found))
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
            if block.hash is not None:
                continue
            named = self.cached.get(hashes[i])
            if named is not None and self._whole(block.id) and not self._whole(named):
                self.blocks[named].hash = None  # the name goes to the copy with its window part
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
        first = len(seq.block_ids)
        windowed = need - max(0, min(need, seq.window_from - first))
        if self.windows is not None and windowed > self.windows.available:
            raise NoFreeBlocks(f"need {windowed} window blocks, {self.windows.available} free")
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its content from the prefix cache
                del self.cached[block.hash]
                self.cache_version += 1
                block.hash = None
            block.ref_count = 1
            if self.windows is not None:
                self.windows.forget(block_id)
                if len(seq.block_ids) >= seq.window_from:
                    self.windows.acquire(block_id)
            seq.block_ids.append(block_id)

    def release(self, seq: Sequence) -> None:
        """Drop seq's references, tail first; it then holds no blocks and no computed KV."""
        self._drop_windows(seq, len(seq.block_ids))
        seq.window_from = 0
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
            if self.windows is not None and i >= seq.window_from:
                self.windows.drop(block_id, named=False)
            block.ref_count = 0
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)
        del seq.block_ids[keep:]

    # -- window blocks (window_pool.py) -------------------------------------------------

    def slide(self, seq: Sequence) -> None:
        """Let go of the window part of seq's blocks its next pass cannot read (called once
        its computed blocks are saved: a saved block carries its window part)."""
        if self.windows is None:
            return
        first = self.windows.first_kept(seq.num_computed_tokens, self.block_size)
        self._drop_windows(seq, first)
        seq.window_from = max(seq.window_from, first)

    def savable(self, block_id: int) -> bool:
        """Whether a block's every part is in the pool (a store value must be whole)."""
        return self._whole(block_id)

    def _whole(self, block_id: int) -> bool:
        return self.windows is None or self.windows.has(block_id)

    def _drop_windows(self, seq: Sequence, end: int) -> None:
        if self.windows is None:
            return
        for block_id in seq.block_ids[seq.window_from : end]:
            self.windows.drop(block_id, named=self.blocks[block_id].hash is not None)

    def _hold_windows(self, seq: Sequence, prefix: int) -> None:
        """seq holds a prefix of `prefix` blocks: hold the window part of its last ones."""
        if self.windows is None:
            return
        seq.window_from = max(0, prefix - self.windows.keep_blocks)
        for block_id in seq.block_ids[seq.window_from : prefix]:
            self.windows.acquire(block_id)

    def _windowed(self, found: Seq[int], end: int | None = None) -> int:
        """How many of the cached blocks `found` a prefix can use: it ends where the
        window part of its last blocks is still there. `end`: a prefix `end` blocks long is
        wanted, the blocks past `found` come with their window part: it stops at the first of
        `found` among the last ones lacking its own."""
        assert self.windows is not None
        has, keep = self.windows.has, self.windows.keep_blocks
        if end is not None:
            return next(
                (i for i in range(max(0, end - keep), min(len(found), end)) if not has(found[i])),
                len(found),
            )
        for k in range(len(found), 0, -1):
            if all(has(b) for b in found[max(0, k - keep) : k]):
                return k
        return 0

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
        if self.windows is not None:  # a cached block lacking its window part: fill a new one
            found = found[: self._windowed(found, len(hashes))]
        fresh = len(hashes) - len(found)
        short = self._short(found, len(hashes))
        if short:
            raise NoFreeBlocks(short)
        self._reference(found)
        seq.block_ids = list(found)
        self._hold_windows(seq, len(hashes))  # past `found`: allocate takes them
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
        if self.windows is not None:
            tail = max(0, full - self.windows.keep_blocks)
            kept = sum(self.windows.refs[b] == 0 for b in found[tail:])  # evictable, now held
            need = full - max(tail, len(found)) + partial
            room = self.windows.available - kept
            if need > room:
                return f"need {need} window blocks, {room} free"
        return ""

    def admit_external(
        self, seq: Sequence, hashes: Seq[bytes], partial_tokens: int, skipped: int
    ) -> list[tuple[int, int]] | None:
        """Give `seq` (holding no blocks) a prefix held outside the pool: full blocks named by
        `hashes`, then `partial_tokens` more; blocks this pool caches are shared, the others
        allocated. Returns (index in the prefix, block id) for each block the caller must fill
        (before anything reads it: they are named now), or None, nothing changed, when the
        pool is short. At least one token is left to compute. The first `skipped` blocks have
        no values outside: where they are no longer cached (or, with window blocks, the last
        ones lack their window part), the prefix stops there."""
        usable = min(len(hashes) * self.block_size + partial_tokens, seq.num_tokens - 1)
        full = min(len(hashes), usable // self.block_size)
        partial = usable - full * self.block_size if full == len(hashes) else 0
        cached = self.lookup(hashes[:full])
        if self.windows is not None:
            cached = cached[: self._windowed(cached, full)]
        if len(cached) < skipped:
            full, partial = len(cached), 0
            if self.windows is not None:
                full = self._windowed(cached)
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
        if self.windows is not None:
            self.windows.check(set(self.cached.values()))

    def referenced_blocks(self) -> int:
        return self.num_blocks - len(self.free)  # every block is free or referenced (check())
