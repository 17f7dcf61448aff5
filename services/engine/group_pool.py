"""The blocks of a cache group whose part of a token is read only while the token is recent
(a sliding window's K and V; DeepSeek-V4's window key and its compressors' inputs): a pool of
their own, so that a 10,000-token sequence holds `keep` tokens of that part, not 10,000.

A block holds a group block (`table[block]`, the KV cache's list) from its allocation until
every sequence holding the block has moved `keep` tokens past it (`refs`: the sequences whose
reach covers it). With none, it stays with its block while the block is named (a prefix others
may match: the part of a cached prefix's last blocks is what lets a new sequence continue from
it), evictable least recently released first, and goes back to the free list otherwise.

The block manager owns one pool per such group and calls each through the same methods, in
which a sequence's blocks before `seq.pool_marks[name]` hold no part of this group. Groups read
for good need no pool: their blocks are the blocks (docs/structures.md, "Cache groups").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from services.engine.request import Sequence
from services.model.cache_spec import CacheSpec
from services.settings import EngineConfig


def pool_sizes(
    spec: CacheSpec, config: EngineConfig, itemsize: int, budget: int
) -> tuple[int, dict[str, int]]:
    """Blocks, and each early-released group's blocks, from the settings: --num-blocks, or as
    many as the KV budget (bytes: pool_budget.py) holds. A group gets as many blocks as the
    running sequences' reach and a step's new tokens can hold at once; the rest of the budget
    goes to blocks. A group as large as the pool would be gets one block per block."""
    bs = config.block_size
    whole = bs * spec.elements * itemsize
    early = [g for g in spec.groups if not g.lasting]
    wanted = {
        g.name: config.max_num_seqs * (-(-(g.keep or 0) // bs) + 3)
        + -(-config.max_num_batched_tokens // bs)
        for g in early
    }
    if config.num_blocks:
        return config.num_blocks, {n: min(config.num_blocks, w) for n, w in wanted.items()}
    part = {g.name: bs * spec.group_elements(g) * itemsize for g in early}
    lasting = whole - sum(part.values())  # a block's bytes in the groups read for good
    if not early or max(wanted.values()) * whole >= budget or lasting == 0:
        return max(1, budget // whole), {}
    return (budget - sum(wanted[n] * part[n] for n in wanted)) // lasting, wanted


class GroupPool:
    def __init__(
        self, name: str, num_slots: int, table: list[int], keep: int, block_size: int
    ) -> None:
        self.name = name
        self.table = table  # block -> group block, -1 for none (the KV cache's list)
        table[:] = [-1] * len(table)
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end
        self.refs = [0] * len(table)  # block -> sequences whose reach covers it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # blocks: no refs, named
        self.keep_blocks = -(-keep // block_size)  # a prefix's last blocks needing theirs
        self.keep = keep
        self.block_size = block_size

    @property
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def has(self, block: int) -> bool:
        return self.table[block] >= 0

    def first(self, seq: Sequence) -> int:
        """The first of seq's blocks whose part it holds."""
        return seq.pool_marks.get(self.name, 0)

    # -- a sequence's blocks (BlockManager calls these) ------------------------------------

    def usable(self, found: Seq[int], end: int | None = None) -> int:
        """How many of the cached blocks `found` a prefix can use: it ends where the part of
        its last blocks is still there. `end`: a prefix `end` blocks long is wanted, the
        blocks past `found` come with their part: it stops at the first of `found` among the
        last ones lacking its own."""
        if end is not None:
            tail = range(max(0, end - self.keep_blocks), min(len(found), end))
            return next((i for i in tail if not self.has(found[i])), len(found))
        for k in range(len(found), 0, -1):
            if all(self.has(b) for b in found[max(0, k - self.keep_blocks) : k]):
                return k
        return 0

    def hold_prefix(self, seq: Sequence, prefix: int) -> None:
        """seq holds a prefix of `prefix` blocks: hold the part of its last ones."""
        seq.pool_marks[self.name] = max(0, prefix - self.keep_blocks)
        for block in seq.block_ids[self.first(seq) : prefix]:
            self.acquire(block)

    def shortfall(self, seq: Sequence, need: int) -> str:
        """Why `need` more blocks of seq cannot have their part ("" when they can)."""
        first = len(seq.block_ids)
        parts = need - max(0, min(need, self.first(seq) - first))
        if parts > self.available:
            return f"need {parts} {self.name!r} group blocks, {self.available} free"
        return ""

    def allocated(self, seq: Sequence, index: int, block: int) -> None:
        """Block `block`, reused for other content, is seq's `index`-th."""
        self.forget(block)
        if index >= self.first(seq):
            self.acquire(block)

    def released(self, seq: Sequence, named: Seq[bool]) -> None:
        """seq lets go of all its blocks (`named[i]`: its i-th block is named)."""
        for i, block in enumerate(seq.block_ids[self.first(seq) :], self.first(seq)):
            self.drop(block, named[i])
        seq.pool_marks.pop(self.name, None)

    def truncated(self, seq: Sequence, index: int, block: int) -> None:
        """seq's `index`-th block (never named) goes back."""
        if index >= self.first(seq):
            self.drop(block, named=False)

    def slide(self, seq: Sequence, named: Seq[bool]) -> None:
        """Let go of the part of seq's blocks its next pass cannot read."""
        first = max(0, (seq.num_computed_tokens - self.keep) // self.block_size)
        for i in range(self.first(seq), first):
            self.drop(seq.block_ids[i], named[i])
        seq.pool_marks[self.name] = max(self.first(seq), first)

    def short(self, found: Seq[int], full: int, partial: bool) -> str:
        """Why a prefix of `full` blocks (`found` of them cached), and a partial one after it,
        lacks parts ("" when it fits)."""
        tail = max(0, full - self.keep_blocks)
        kept = sum(self.refs[b] == 0 for b in found[tail:])  # evictable, now held
        need = full - max(tail, len(found)) + partial
        room = self.available - kept
        return f"need {need} {self.name!r} group blocks, {room} free" if need > room else ""

    # -- group blocks ---------------------------------------------------------------------

    def acquire(self, block: int) -> None:
        """Hold `block`'s group block, giving it one (empty) if it has none."""
        if self.table[block] < 0:
            if not self.free:
                victim, _ = self.evictable.popitem(last=False)
                self._free(victim)
            self.table[block] = self.free.pop()
        elif self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1

    def drop(self, block: int, named: bool) -> None:
        """Stop holding `block`'s group block: kept while the block is named and nobody else
        needs the room, freed otherwise."""
        assert self.refs[block] > 0, f"{self.name} part of block {block} dropped twice"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if named:
                self.evictable[block] = None
            else:
                self._free(block)

    def forget(self, block: int) -> None:
        """`block` is reused for other content: its group block, if kept, goes free."""
        if self.table[block] >= 0:
            assert self.refs[block] == 0, f"block {block} reused while its part is held"
            del self.evictable[block]
            self._free(block)

    def _free(self, block: int) -> None:
        self.free.append(self.table[block])
        self.table[block] = -1

    def check(self, named: set[int]) -> None:
        """The pool's invariants (`named`: the blocks the prefix cache names)."""
        held = [w for w in self.table if w >= 0]
        assert len(held) == len(set(held)), f"a {self.name} block given to two blocks"
        assert len(held) + len(self.free) == self.num_slots, f"{self.name} blocks lost"
        for block, w in enumerate(self.table):
            assert self.refs[block] >= 0
            if self.refs[block] > 0:
                assert w >= 0, f"block {block}'s {self.name} part is held but missing"
            elif w >= 0:
                assert block in self.evictable and block in named, f"block {block}'s part leaks"
