"""Async scheduling with speculative decoding (services/engine/inflight.py: tokens placed
early) gives the synchronous engine's results exactly, with the same proposals verified: n-gram
and suffix lookup, a draft model (seeded sampling verified by rejection sampling) and DeepSeek
V3's and V4's MTP layers, each in every dtype `--dtype auto` may pick here; stop strings found
with the text, after the tokens past them were placed, end the sequence where they fall.
test_speculative.py's suite runs again with it on in test_async_speculative.py."""

from __future__ import annotations

import pytest

from services.engine.engine import Engine, EngineConfig
from services.engine.outputs import RequestOutput
from services.engine.params import SamplingParams
from services.model.loader import load_model, load_mtp
from services.settings import SpeculativeConfig
from tests.services.engine import test_mtp as mtp_suite
from tests.services.engine import test_speculative as suite
from tests.services.engine import test_speculative_draft as draft_suite
from tests.support.dtypes import COMPUTE_DTYPES

model, checkpoints = suite.model, mtp_suite.checkpoints  # their fixtures


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory, embedded_dir):
    return draft_suite.checkpoints(tmp_path_factory, embedded_dir)[:2]


MIX = [
    SamplingParams(max_tokens=40, temperature=0.0, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.8, seed=5, logprobs=1),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["b", "sat", "green", "Thursday"]),
    SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=9, stop=[","], n=2),
    SamplingParams(max_tokens=7, temperature=0.0, stop_token_ids=[13]),
    SamplingParams(max_tokens=40, temperature=0.6, seed=2, presence_penalty=0.4, min_tokens=5),
]


def outcome(outputs: list[RequestOutput]) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.logprobs) for o in outputs for c in o.choices]


def both(make, prompts, params) -> tuple[Engine, Engine]:
    """An engine made with async scheduling off and one with it on, each run on the prompts;
    the outcomes and what speculation verified are asserted equal."""
    sync, overlapped = make("off"), make("on")
    expected = outcome(sync.generate(prompts, params))
    assert overlapped.flight.overlap and overlapped.flight.early
    assert outcome(overlapped.generate(prompts, params)) == expected
    assert sync.speculator is not None and overlapped.speculator is not None
    assert overlapped.speculator.stats == sync.speculator.stats
    assert sync.speculator.stats.proposed > 0 and sync.speculator.stats.accepted > 0
    assert overlapped.times.overlapped > 0
    for eng in (sync, overlapped):
        eng.check()
        assert eng.blocks.referenced_blocks() == 0 and not eng.requests
    return sync, overlapped


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_lookup_proposals_verified_ahead_give_the_synchronous_results(model, method):
    spec = SpeculativeConfig(method, num_tokens=4, max_batch=64)

    def make(overlap: str) -> Engine:
        config = EngineConfig(num_blocks=400, speculative=spec, async_scheduling=overlap)
        return Engine(model.model, model.tokenizer, config)

    prompts = suite.grounded(model, 12)
    params = [MIX[i % len(MIX)] for i in range(len(prompts))]
    _, overlapped = both(make, prompts, params)
    assert overlapped.flight.overlap and overlapped.flight.early
    assert overlapped.flight.taken_back > 0  # a stop string fell inside an accepted run


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_a_draft_models_proposals_verified_ahead_give_the_synchronous_results(draft_dirs, dtype):
    target, draft = (load_model(str(d), dtype=dtype, device="cpu") for d in draft_dirs)

    def make(overlap: str) -> Engine:
        config = EngineConfig(
            num_blocks=256, speculative=draft_suite.DRAFT, async_scheduling=overlap
        )
        return Engine(target.model, target.tokenizer, config, draft=draft.model)

    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.9,
            seed=3 + i,
            ignore_eos=True,
            logprobs=1,
            stop=["e"] if i % 3 == 0 else [],
        )
        for i in range(len(draft_suite.PROMPTS))
    ]
    sync, _ = both(make, draft_suite.PROMPTS, params)
    assert sync.speculator is not None
    assert sync.speculator.stats.accepted < sync.speculator.stats.proposed  # some refused


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("family", ["v3", "v4"])
def test_mtp_drafts_verified_ahead_give_the_synchronous_results(checkpoints, family, dtype):
    path = checkpoints[family, "copy"]
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    m = loaded.model
    mtp = load_mtp(path, loaded.config, m.dtype, m.device, m.kernels)

    def make(overlap: str) -> Engine:
        config = EngineConfig(num_blocks=256, speculative=mtp_suite.MTP, async_scheduling=overlap)
        return Engine(m, loaded.tokenizer, config, draft=mtp)

    _, overlapped = both(make, mtp_suite.prompts(), mtp_suite.PARAMS)
    assert overlapped.speculator is not None
    proposer = overlapped.speculator.proposer
    assert not proposer.states and proposer.blocks.num_free == 256  # type: ignore[attr-defined]
