"""Async scheduling (services/engine/inflight.py) gives the synchronous engine's results exactly:
tokens, logprobs, text and finish reasons, greedy and seeded, for every model family and in
every dtype `--dtype auto` picks here; with stops that end a sequence one step early (the
token it drew in the step already scheduled is dropped), n choices, penalties, chunked
prompts, preemption, prompt scoring and aborts. The determinism and feature suites run again
with it on in test_async_suites.py."""

from __future__ import annotations

import pytest
import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.inflight import async_scheduling
from services.engine.outputs import RequestOutput
from services.engine.request import EngineRequest
from services.engine.runner import PLACEHOLDER
from services.model.loader import LoadedModel
from tests.services.engine import test_determinism as suite

GREEDY, SEEDED, prompt, with_ = suite.GREEDY, suite.SEEDED, suite.prompt, suite.with_
family, dtype, model = suite.family, suite.dtype, suite.model  # its fixtures
deepseek_dir = suite.deepseek_dir

MIX = [
    GREEDY,
    SEEDED,
    with_(GREEDY, max_tokens=1),
    with_(SEEDED, max_tokens=2, n=2),
    with_(GREEDY, max_tokens=12, ignore_eos=False, stop=[" the", "."], logprobs=None),
    with_(SEEDED, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    with_(GREEDY, logit_bias={11: 5.0, 13: -3.0}, logprobs=None),
    with_(SEEDED, ignore_eos=False, min_tokens=3, max_tokens=10, temperature=1.3),
    with_(GREEDY, prompt_logprobs=1, max_tokens=3),
    with_(SEEDED, top_p=1.0, top_k=0, min_p=0.05, max_tokens=6),
    with_(GREEDY, max_tokens=16, stop_token_ids=[13, 11, 198], logprobs=None),
    with_(SEEDED, seed=99, max_tokens=9),
]
LENGTHS = [3, 17, 33, 40, 49, 64, 65, 81, 100, 111, 16, 31]


def engine(model: LoadedModel, overlap: str, num_blocks: int = 128, **config) -> Engine:
    config = {"async_scheduling": overlap, "num_blocks": num_blocks, **config}
    return Engine(model.model, model.tokenizer, EngineConfig(**config))


def outcome(outputs: list[RequestOutput]) -> list[tuple]:
    return [
        (c.token_ids, c.text, c.finish_reason, c.logprobs, o.prompt_logprobs)
        for o in outputs
        for c in o.choices
    ]


@pytest.mark.parametrize(
    ("blocks", "budget", "chunk"),
    [(128, 512, None), (14, 24, 8)],  # roomy; a small pool (preemptions) and chunked prompts
    ids=["roomy", "preempting"],
)
def test_async_steps_give_the_synchronous_results(model, blocks, budget, chunk):
    prompts = [prompt(n, seed=100 + i) for i, n in enumerate(LENGTHS)]
    config = {"max_num_batched_tokens": budget, "prefill_chunk_size": chunk}
    sync = engine(model, "off", blocks, **config)
    expected = outcome(sync.generate(prompts, MIX))
    overlapped = engine(model, "on", blocks, **config)
    assert overlapped.flight.overlap
    assert outcome(overlapped.generate(prompts, MIX)) == expected
    assert overlapped.times.overlapped > 0  # the host applied tokens while a pass ran
    if blocks == 14:
        assert overlapped.scheduler.num_preemptions > 0
    assert not overlapped.requests
    overlapped.check()
    assert overlapped.blocks.referenced_blocks() == 0


def test_a_stop_ends_the_sequence_and_its_next_token_is_dropped(model):
    """The stop token is known one step late: the sequence was in the next step already."""
    params = with_(GREEDY, max_tokens=30, logprobs=None)
    ids = prompt(20, seed=7)
    free = engine(model, "off").generate([ids], params)[0].choices[0].token_ids
    stop_at = free[4]
    stopped = with_(params, stop_token_ids=[stop_at])
    expected = outcome(engine(model, "off").generate([ids], stopped))
    eng = engine(model, "on")
    eng.add_request(EngineRequest("r", ids, stopped))
    seq = eng.requests["r"].seqs[0]
    steps = 0
    while eng.has_unfinished:
        eng.step()
        steps += 1
        assert PLACEHOLDER not in seq.token_ids[: seq.num_tokens - 1]
    assert seq.output_ids == expected[0][0] and seq.output_ids[-1] == stop_at
    first = free.index(stop_at) + 1  # the sequence's tokens; one more pass, then the resolve
    assert steps == first + 1
    eng.check()


def test_an_abort_while_a_token_is_on_the_device_leaves_the_others_exact(model):
    prompts = [prompt(n, seed=200 + n) for n in (40, 9, 70)]
    params = with_(SEEDED, max_tokens=10)
    expected = outcome(engine(model, "off").generate([prompts[0], prompts[2]], params))
    eng = engine(model, "on")
    for i, ids in enumerate(prompts):
        eng.add_request(EngineRequest(f"r{i}", ids, params))
    kept = [eng.requests["r0"].seqs[0], eng.requests["r2"].seqs[0]]
    aborted = eng.requests["r1"].seqs[0]
    delivered = 0
    for _ in range(4):
        delivered += sum(len(d.token_ids) for d in eng.step() if d.request_id == "r1")
    assert eng.flight.overlap and eng.flight.sampled is not None
    assert aborted in eng.flight.sampled.seqs
    (delta,) = eng.abort("r1")
    assert delta.num_output_tokens == delivered  # not the one still on the device
    assert PLACEHOLDER not in aborted.token_ids
    eng.check()
    while eng.has_unfinished:
        eng.step()
    assert PLACEHOLDER not in aborted.token_ids
    got = [(s.output_ids, s.text, s.finish_reason, s.logprobs) for s in kept]
    assert got == [e[:4] for e in expected]
    assert eng.blocks.referenced_blocks() == 0


def test_auto_is_on_with_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert async_scheduling("auto", cuda)
    assert not async_scheduling("auto", cpu)
    assert async_scheduling("on", cpu)
    assert not async_scheduling("off", cuda)
