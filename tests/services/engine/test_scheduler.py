"""Continuous batching with tiny sizes: running sequences first, then waiting prompts cut to
the budget left, so every step is filled; exact chunks per step."""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.params import SamplingParams
from services.engine.request import Sequence
from services.engine.scheduler import Scheduler
from services.settings import EngineConfig


def seq(rid: str, n: int, arrival: int) -> Sequence:
    tokens = [1000 + arrival * 100 + i for i in range(n)]  # distinct: no prefix shared
    return Sequence(rid, 0, n, tokens, SamplingParams(), 0, arrival)


def step(s: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule one step and apply it as the engine would (a token for each finished chunk)."""
    out = s.schedule()
    for c in out.chunks:
        c.seq.num_computed_tokens += c.num_tokens
        s.blocks.commit(c.seq)
        if c.want_logits:
            c.seq.token_ids.append(7)
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_prompt_chunks_fill_the_budget_left_by_decodes():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=18, prefill_chunk_size=8)
    s = Scheduler(config, BlockManager(64, 4, "ns"))
    for i, n in enumerate((3, 3, 3)):  # three short prompts: decoding after one step
        s.add(seq(f"d{i}", n, i))
    assert step(s) == [("d0", 0, 3), ("d1", 0, 3), ("d2", 0, 3)]
    s.add(seq("a", 19, 3))
    s.add(seq("b", 10, 4))
    # 3 decode tokens, then a's chunk (8, its cap), then b cut to the 7 tokens left
    assert step(s) == [("d0", 3, 1), ("d1", 3, 1), ("d2", 3, 1), ("a", 0, 8), ("b", 0, 7)]
    # a goes on at its cap; the rest of b's prompt
    assert step(s) == [("d0", 4, 1), ("d1", 4, 1), ("d2", 4, 1), ("a", 8, 8), ("b", 7, 3)]
    assert step(s) == [("d0", 5, 1), ("d1", 5, 1), ("d2", 5, 1), ("a", 16, 3), ("b", 10, 1)]


def test_a_full_step_leaves_the_next_prompt_waiting():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=8, prefill_chunk_size=8)
    s = Scheduler(config, BlockManager(64, 4, "ns"))
    s.add(seq("a", 8, 0))
    s.add(seq("b", 5, 1))
    assert step(s) == [("a", 0, 8)]
    assert [q.request_id for q in s.waiting] == ["b"]
    assert step(s) == [("a", 8, 1), ("b", 0, 5)]
