"""Window blocks: the part of a block a model reads only while its tokens are recent.

DeepSeek-V4 keeps, per token, a window key and its compressors' inputs that no query reads
once the token is `keep` tokens behind the sequence's next one, beside shares of compressed
entries read for good (v4_config.LayerRow); gpt-oss and Gemma 3 keep their sliding layers' K
and V beside their full layers'. The lasting part stays in the block; the window part lives in
a window block of its own, `window_of[block]`, from the block's allocation until every
sequence holding the block has moved `keep` tokens past it.

A window block is held by the sequences whose window covers its block (`refs`). With none, it
stays with its block while the block is named (a prefix others may match: the window part of
a cached prefix's last blocks is what lets a new sequence continue from it), evictable least
recently released first, and goes back to the free list otherwise. So a 10,000-token sequence
holds `keep` tokens of window part, not 10,000 (docs/structures.md, "Window blocks").

The block manager owns this pool and calls it; the KV cache reads `window_of` (the same list).
"""

from __future__ import annotations

from collections import OrderedDict

from services.model.config import ModelConfig
from services.settings import EngineConfig


def pool_sizes(
    mc: ModelConfig, config: EngineConfig, itemsize: int, budget: int
) -> tuple[int, int | None]:
    """Blocks, and window blocks (None: one per block), from the settings: --num-blocks, or as
    many as the KV budget (bytes: pool_budget.py) holds. Window blocks: as many as the
    running sequences' windows and a step's new tokens can hold at once, the rest of the
    budget in blocks without a window part."""
    bs = config.block_size
    whole = mc.cache_layers * bs * mc.cache_elements * itemsize
    if not mc.window_elements:
        return config.num_blocks or max(1, budget // whole), None
    keep = -(-mc.window_keep // bs)
    wanted = config.max_num_seqs * (keep + 3) + -(-config.max_num_batched_tokens // bs)
    if config.num_blocks:
        return config.num_blocks, min(config.num_blocks, wanted)
    window = bs * mc.window_elements * itemsize
    if wanted * whole >= budget or window == whole:
        return max(1, budget // whole), None
    return (budget - wanted * window) // (whole - window), wanted


class WindowPool:
    def __init__(self, num_slots: int, window_of: list[int], keep: int, block_size: int) -> None:
        self.window_of = window_of  # block -> window block, -1 for none (KVCache's list)
        window_of[:] = [-1] * len(window_of)
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end
        self.refs = [0] * len(window_of)  # block -> sequences whose window covers it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # blocks: no refs, named
        self.keep_blocks = -(-keep // block_size)  # a prefix's last blocks needing theirs
        self.keep = keep

    @property
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def has(self, block: int) -> bool:
        return self.window_of[block] >= 0

    def first_kept(self, num_computed: int, block_size: int) -> int:
        """The first block a sequence's next pass may read the window part of."""
        return max(0, (num_computed - self.keep) // block_size)

    def acquire(self, block: int) -> None:
        """Hold `block`'s window block, giving it one (empty) if it has none."""
        if self.window_of[block] < 0:
            if not self.free:
                victim, _ = self.evictable.popitem(last=False)
                self._free(victim)
            self.window_of[block] = self.free.pop()
        elif self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1

    def drop(self, block: int, named: bool) -> None:
        """Stop holding `block`'s window block: kept while the block is named and nobody else
        needs the room, freed otherwise."""
        assert self.refs[block] > 0, f"window of block {block} dropped twice"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if named:
                self.evictable[block] = None
            else:
                self._free(block)

    def forget(self, block: int) -> None:
        """`block` is reused for other content: its window block, if kept, goes free."""
        if self.window_of[block] >= 0:
            assert self.refs[block] == 0, f"block {block} reused while its window is held"
            del self.evictable[block]
            self._free(block)

    def _free(self, block: int) -> None:
        self.free.append(self.window_of[block])
        self.window_of[block] = -1

    def check(self, named: set[int]) -> None:
        """The pool's invariants (`named`: the blocks the prefix cache names)."""
        held = [w for w in self.window_of if w >= 0]
        assert len(held) == len(set(held)), "a window block given to two blocks"
        assert len(held) + len(self.free) == self.num_slots, "window blocks lost"
        for block, w in enumerate(self.window_of):
            assert self.refs[block] >= 0
            if self.refs[block] > 0:
                assert w >= 0, f"block {block}'s window is held but missing"
            elif w >= 0:
                assert block in self.evictable and block in named, f"block {block}'s window leaks"
