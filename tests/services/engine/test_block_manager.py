"""The block pool with tiny sizes: exact block ids, reference counts and eviction order."""

from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager, NoFreeBlocks
from services.engine.params import SamplingParams
from services.engine.request import Sequence

BS = 4


def seq(tokens, arrival=0, salt=b""):
    return Sequence("r", 0, len(tokens), list(tokens), SamplingParams(), 0, arrival, salt)


def computed(bm, s, n):
    """Allocate and mark n more tokens of s as computed, as the engine does after a pass."""
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.commit(s)


def test_allocate_in_order_and_release_tail_first():
    bm = BlockManager(6, BS, "ns")
    a = seq(range(10))
    computed(bm, a, 10)
    assert a.block_ids == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(6)] == [1, 1, 1, 0, 0, 0]
    bm.release(a)
    # free list: never-used blocks first, then a's blocks tail first
    assert list(bm.free) == [3, 4, 5, 2, 1, 0]
    assert a.block_ids == [] and a.num_computed_tokens == 0
    bm.check()


def test_full_blocks_are_cached_and_shared():
    bm = BlockManager(8, BS, "ns")
    a = seq(range(10))
    computed(bm, a, 10)
    assert bm.num_cached == 2  # two full blocks; the partial one is not named
    b = seq([*range(8), 99, 98, 97])
    assert bm.admit(b) == 8
    assert b.block_ids == [0, 1]
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2
    bm.check()


def test_admit_leaves_one_token_to_compute():
    bm = BlockManager(8, BS, "ns")
    a = seq(range(8))
    computed(bm, a, 8)
    b = seq(range(8))
    assert bm.admit(b) == 4  # not 8: the last token's logits are needed


def test_cached_blocks_stay_matchable_after_release_until_evicted_lru():
    bm = BlockManager(4, BS, "ns")
    a = seq(range(8))
    computed(bm, a, 8)
    bm.release(a)
    assert bm.num_cached == 2 and bm.num_free == 4
    c = seq(range(100, 108))
    computed(bm, c, 4)  # takes block 2: free and never named, least recently freed
    assert c.block_ids == [2] and bm.num_cached == 3
    computed(bm, c, 4)  # then 3, then the named ones: block 1 (a's tail) before block 0
    computed(bm, c, 1)
    assert c.block_ids == [2, 3, 1]
    assert bm.lookup(bm.hashes(seq(range(8)))) == [0]
    bm.check()


def test_allocation_failure_changes_nothing():
    bm = BlockManager(2, BS, "ns")
    a = seq(range(12))
    with pytest.raises(NoFreeBlocks):
        bm.allocate(a, 12)
    assert a.block_ids == [] and bm.num_free == 2
    bm.check()


def test_salt_isolates_tenants():
    bm = BlockManager(8, BS, "ns")
    computed(bm, seq(range(9), salt=b"alice"), 9)
    assert bm.admit(seq(range(9), salt=b"bob")) == 0
    assert bm.admit(seq(range(9), salt=b"alice")) == 8


def test_export_then_import_elsewhere():
    prefill = BlockManager(8, BS, "ns")
    a = seq(range(10))
    computed(prefill, a, 10)
    exported = prefill.export(a)
    assert [b for _, b in exported] == [0, 1]

    decode = BlockManager(8, BS, "ns")
    other = seq(range(4))
    computed(decode, other, 4)  # decode already holds block 0's content
    b = seq(range(10))
    to_fill = decode.import_prefix(b, [h for h, _ in exported])
    assert to_fill == [1]  # only the second block needs its KV written
    assert b.block_ids[0] == other.block_ids[0] and b.num_computed_tokens == 8
    decode.commit(b)
    assert decode.num_cached == 2
    decode.check()


def test_check_catches_a_corrupted_pool():
    bm = BlockManager(4, BS, "ns")
    a = seq(range(4))
    computed(bm, a, 4)
    bm.blocks[a.block_ids[0]].ref_count = 0  # referenced by a, yet not on the free list
    with pytest.raises(AssertionError, match="free \\+ used"):
        bm.check()
