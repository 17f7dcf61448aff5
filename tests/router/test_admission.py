"""The sequences-in-flight count behind 429s: a request holds prompts x n places, gives every
place back (after a request, after a stream the server never started because its client
left first) and never twice; a request larger than the whole count is a 400, not a 429."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from router.completions.answer import Replies, stream_events
from router.completions.openai_format import Envelope
from router.errors import APIError
from router.state import RouterState
from router.workers.jobs import Job
from services.engine.params import SamplingParams
from services.rpc import worker_pb2 as pb
from services.settings import RouterSettings, Settings


def jobs(prompts: int = 1, n: int = 1) -> list[Job]:
    return [Job(f"r-{i}", [1, 2], pb.SamplingParams(), 0, n) for i in range(prompts)]


def test_places_are_given_back_once_even_by_unstarted_streams():
    state = RouterState.create(Settings(router=RouterSettings(max_pending=2)))
    first, second = state.admit(jobs()), state.admit(jobs())
    with pytest.raises(APIError) as refused:
        state.admit(jobs())
    assert refused.value.status == 429 and state.pending == 2
    first.release()
    first.release()
    assert state.pending == 1

    envelope = Envelope("id", "text_completion", 0, "m")
    replies = Replies(envelope, lambda *a: {}, lambda *a: {})
    body = stream_events(state, [], second, False, replies, 0)
    weakref.finalize(body, second.release)  # as respond() does
    del body
    gc.collect()
    assert state.pending == 0
    assert state.metrics.waiting._value.get() == 0


def test_a_finished_run_gives_its_place_back():
    state = RouterState.create(Settings(router=RouterSettings()))
    admission = state.admit(jobs())

    async def drain() -> None:
        async for _ in state.run([], admission):
            pass

    asyncio.run(drain())
    assert state.pending == 0 and admission.released


def test_a_request_holds_a_place_per_sequence():
    state = RouterState.create(Settings(router=RouterSettings(max_pending=16)))
    big = state.admit(jobs(prompts=2, n=4))  # 8 sequences
    assert state.pending == 8
    with pytest.raises(APIError) as refused:
        state.admit(jobs(prompts=3, n=3))  # 9 more do not fit now: retry later
    assert refused.value.status == 429
    state.admit(jobs(n=8))
    assert state.pending == 16
    big.release()
    assert state.pending == 8


def test_a_request_larger_than_the_server_admits_is_400():
    state = RouterState.create(Settings(router=RouterSettings(max_pending=256)))
    with pytest.raises(APIError) as refused:
        state.admit(jobs(prompts=64, n=16))  # 1,024 sequences could never be admitted
    assert refused.value.status == 400 and refused.value.param == "n"
    assert "1024 sequences" in refused.value.message and state.pending == 0


def test_a_prompts_block_hashes_are_computed_once_per_request(monkeypatch):
    """Once per prompt when the request is read; routing, backlogs, the TTFT SLO's spill and
    shedding, and every choice then use the job's own."""
    from router.workers import generation

    calls = []
    counted = generation.block_hashes

    def counting(*args, **kwargs):
        calls.append(args[0])
        return counted(*args, **kwargs)

    monkeypatch.setattr(generation, "block_hashes", counting)
    settings = RouterSettings(ttft_slo=1.0, disagg_threshold=4)
    state = RouterState.create(Settings(router=settings))
    prompts = [list(range(100, 150)), list(range(200, 240))]
    made = state.jobs("r", prompts, SamplingParams(n=3), None, b"tenant")
    assert calls == prompts  # once each
    assert [len(job.block_hashes) for job in made] == [4, 3]  # 3 full + 1 partial; 2 + 1
    state.shed(made)
    for job in made:
        assert not state.pipeline._compute_on_decode(job)
        assert not state.pipeline._spill(job)
    state.pipeline.expected_wait(made)
    assert calls == prompts
