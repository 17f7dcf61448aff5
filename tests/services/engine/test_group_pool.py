"""A cache group released early (services/engine/group_pool.py), here a window: exact holdings
with tiny sizes, then the engine with a group pool far smaller than its block pool (DeepSeek-V4's
window part, gpt-oss's and Gemma 3's sliding layers)."""

from __future__ import annotations

import pytest
import torch

from decode.connector import DecodeConnector
from kvstore.block_hash import block_hashes
from prefill.connector import PrefillConnector
from services.engine.block_manager import BlockManager, NoFreeBlocks
from services.engine.engine import Engine
from services.engine.group_pool import GroupPool
from services.engine.kv_connector import ImportedKV, TensorKV
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest, Sequence
from services.model.loader import load_model
from services.settings import EngineConfig
from tests.services.engine.test_kv_connector import InMemory
from tests.support.dtypes import COMPUTE_DTYPES

BS, KEEP = 4, 6  # a pass reads the window part of the 6 tokens before its first: 2 blocks


def manager(blocks: int, slots: int) -> BlockManager:
    return BlockManager(blocks, BS, "ns", pools=[GroupPool("w", slots, [0] * blocks, KEEP, BS)])


def seq(tokens) -> Sequence:
    return Sequence("r", 0, len(tokens), list(tokens), SamplingParams(), 0, 0)


def step(bm: BlockManager, s: Sequence, n: int) -> None:
    """What the engine does around a pass of n tokens of s."""
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.commit(s)
    bm.slide(s)


def steps(bm: BlockManager, s: Sequence, passes: int) -> None:
    """`passes` passes of a block's worth of tokens each."""
    for _ in range(passes):
        step(bm, s, BS)


def held(bm: BlockManager, s: Sequence) -> list[int]:
    """Which of s's blocks (by index) hold their window block."""
    return [i for i, b in enumerate(s.block_ids) if bm.pools[0].refs[b] > 0]


def test_a_long_sequence_holds_the_window_part_of_its_last_blocks_only():
    bm = manager(16, 5)
    a = seq(range(41))
    for _ in range(10):
        step(bm, a, 4)
        bm.check()
    assert held(bm, a) == [8, 9]  # tokens 34..39: the next pass (token 40) reads back to 34
    assert a.pool_marks["w"] == 8
    windows = bm.pools[0]
    # released ones stay with their named blocks, least recently released evicted first
    assert [windows.has(b) for b in a.block_ids] == [False] * 5 + [True] * 5
    assert list(windows.evictable) == a.block_ids[5:8]
    step(bm, a, 1)  # a new block: its window block is the least recently released one's
    assert held(bm, a) == [8, 9, 10] and not windows.has(a.block_ids[5])
    bm.release(a)
    assert bm.num_free == 5  # every window block free or evictable
    bm.check()


def test_a_prefix_hit_ends_where_its_last_blocks_have_their_window_part():
    bm = manager(16, 6)
    a = seq(range(40))
    steps(bm, a, 10)
    bm.release(a)  # blocks 4..9 keep their window part (6 window blocks), 0..3 lost it
    whole = seq([*range(40), 99])
    assert bm.admit(whole) == 40
    assert held(bm, whole) == [8, 9] and whole.pool_marks["w"] == 8
    bm.release(whole)
    six = seq([*range(24), 99])  # 6 blocks: the last two (4, 5) have theirs
    assert bm.admit(six) == 24
    bm.release(six)
    five = seq([*range(20), 99])  # 5 blocks: block 3 has lost its window part, and 2, 1, 0
    assert bm.admit(five) == 0 and five.block_ids == []
    bm.check()


def test_a_recomputed_block_takes_the_name_from_a_copy_without_its_window_part():
    bm = manager(16, 3)
    a = seq(range(16))
    steps(bm, a, 4)  # 3 window blocks: block 0's is evicted by block 3's
    windows = bm.pools[0]
    first = a.block_ids[0]
    assert not windows.has(first)
    bm.release(a)
    b = seq([*range(4), 99])
    assert bm.admit(b) == 0  # block 0 is cached, but without its window part
    step(bm, b, 4)
    assert bm.lookup(bm.hashes(b)[:1]) == [b.block_ids[0]] != [first]
    assert bm.admit(seq([*range(4), 77])) == 4  # the copy serves the next ones
    bm.check()


def test_an_import_refills_a_last_block_that_lost_its_window_part():
    bm = manager(16, 6)
    a = seq(range(16))
    steps(bm, a, 4)
    windows = bm.pools[0]
    assert held(bm, a) == [2, 3]
    windows.forget(a.block_ids[0])  # evicted
    hashes = bm.hashes(a)
    b = seq(range(13))
    assert bm.import_prefix(b, hashes[:3]) == []  # blocks 1, 2 are the last: theirs are there
    assert b.block_ids == a.block_ids[:3] and held(bm, b) == [1, 2]
    c = seq(range(9))
    assert bm.import_prefix(c, hashes[:2]) == [0, 1]  # block 0 has none: both from outside
    assert c.block_ids[1] != a.block_ids[1] and held(bm, c) == [0, 1]
    bm.check()


def test_short_of_window_blocks_an_allocation_changes_nothing():
    bm = manager(16, 3)
    a = seq(range(16))
    assert bm.num_free == 3  # blocks come with a window block each
    with pytest.raises(NoFreeBlocks, match="'w' group blocks"):
        bm.allocate(a, 16)
    assert a.block_ids == [] and len(bm.free) == 16
    step(bm, a, 8)
    bm.allocate(a, 2)  # a draft's slots, then rolled back
    bm.truncate(a)
    assert held(bm, a) == [0, 1]
    bm.check()


# -- the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v4_dir(tiny_dir):
    return tiny_dir("deepseek_v4")


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("family", ["deepseek_v4", "gpt_oss", "gemma3"])
def test_a_small_window_pool_gives_the_tokens_of_one_window_block_per_block(
    tiny_dir, family, dtype
):
    """20 window blocks for 24 blocks, against one per block: five prompts preempt each other
    and come back through the prefix cache, a 300-token prompt runs past every window, the
    earlier prompts come again; sequences let go of window parts as they go (V4: window keys
    and compressor inputs; gpt-oss and Gemma 3: their sliding layers). The tokens are the
    same; the prefix hits shrink where blocks or window parts were reused."""
    loaded = load_model(str(tiny_dir(family)), dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (90, 130, 70)]
    prompts += [prompts[1][:100] + prompts[0][:20], prompts[1]]
    long = torch.randint(100, 49000, (300,), generator=gen).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(**config) -> tuple[Engine, list[list[int]], list[int]]:
        engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(**config))
        tokens, hits = [], []
        for batch in (prompts, [long], [prompts[1]], [prompts[3]]):
            before = engine.blocks.hits
            tokens += [o.choices[0].token_ids for o in engine.generate(batch, params)]
            hits.append(engine.blocks.hits - before)
            engine.blocks.check()
        return engine, tokens, hits

    whole, expected, whole_hits = run(num_blocks=256)
    assert [g.num_blocks for g in whole.runner.kv.mapped] == [256]  # one a block: every part kept
    assert whole_hits == [0, 0, 8, 7]
    small, got, small_hits = run(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)
    (group,) = small.runner.kv.mapped
    keep = -(-(group.group.keep or 0) // 16)
    assert group.num_blocks == 4 * (keep + 3) + 4 == 20
    assert got == expected
    assert small.scheduler.num_preemptions == 1 and small_hits[0] > 0  # came back, cached
    assert small_hits[2:] == [0, 6]


def test_the_kv_budget_goes_to_blocks_past_the_window_pool(v4_dir):
    loaded = load_model(str(v4_dir), dtype="float32", device="cpu")
    config = EngineConfig(kv_cache_gb=0.05, max_num_seqs=4, max_num_batched_tokens=64)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    kv = engine.runner.kv
    (window,) = kv.mapped
    assert window.num_blocks == 4 * (1 + 3) + 4
    used = kv.num_blocks * kv.bytes_per_block + window.num_blocks * window.bytes_per_block
    assert used <= 0.05 * (1 << 30) < used + kv.bytes_per_block
    assert kv.num_blocks > 4 * window.num_blocks


def test_prefill_to_decode_with_window_blocks_and_write_back(v4_dir):
    """The seam with 5 window blocks a side: prefill saves each block with its window part
    before letting it go; decode imports the prompt (window parts for its last blocks only),
    continues exactly, and writes each answer block back as it fills: at the end its early
    blocks' window parts are long gone."""
    loaded = load_model(str(v4_dir), dtype="float32", device="cpu")
    ids = torch.randint(100, 49000, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    config = dict(num_blocks=64, max_num_seqs=1, max_num_batched_tokens=16)

    def engine(io: InMemory | None, **more) -> Engine:
        return Engine(
            loaded.model, loaded.tokenizer, EngineConfig(**config | more), kv_connector=io
        )

    expected = engine(None, num_blocks=256).generate([ids], params)[0].choices[0].token_ids
    saved = InMemory()
    prefill = engine(saved)
    assert [g.num_blocks for g in prefill.runner.kv.mapped] == [5]
    full = block_hashes(ids, 16, prefill.blocks.namespace)
    partial = block_hashes(ids, 16, prefill.blocks.namespace, include_partial=True)[-1]
    prefill.add_request(
        EngineRequest("r", ids, params, block_hashes=full), PrefillConnector(full, partial, None)
    )
    first = [t for d in _drain(prefill) for t in d.token_ids]
    assert first == expected[:1] and sorted(saved.blocks) == [0, 1, 2, 3, 4]
    (window,) = prefill.runner.kv.mapped  # a block's K: its shares, then its window part
    w = window.group.k_width
    assert all(saved.blocks[i][2][..., -w:, :6].abs().sum(-2).min() > 0 for i in range(5))

    k = torch.stack([saved.blocks[i][2] for i in range(5)])
    v = torch.stack([saved.blocks[i][3] for i in range(5)])
    back = InMemory()
    decode = engine(back)
    imported = ImportedKV(full, TensorKV(k, v), 16, partial_tokens=6)
    decode.add_request(
        EngineRequest("r", ids, params, output_ids=first), DecodeConnector(full, imported, True)
    )
    tokens = [*first, *(t for d in _drain(decode) for t in d.token_ids)]
    assert tokens == expected
    answer = block_hashes([*ids, *tokens[:-1]], 16, decode.blocks.namespace)
    assert {i: b[:2] for i, b in back.blocks.items()} == {
        i: (answer[i], 16) for i in range(4, len(answer))
    }
    assert all(back.blocks[i][2][..., -w:, :].abs().sum(-2).min() > 0 for i in back.blocks)
    decode.blocks.check()


def _drain(engine: Engine) -> list:
    deltas = []
    while engine.has_unfinished:
        deltas += engine.step()
    return deltas
