"""The engine end to end on the embedded model (float32; a tiny Qwen3 where only the
scheduling matters: 64 requests under preemption, one seeded among 31): batching,
preemption, prefix caching, seeded sampling, stop strings, n > 1, abort, bad input."""

from __future__ import annotations

import pytest
import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams, ValidationError
from services.engine.request import EngineRequest, FinishReason
from services.model.loader import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def engine(embedded):
    return Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=600))


def alone(embedded, prompt, params, **config):
    """The request run by itself on a fresh engine."""
    eng = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=200, **config))
    return eng.generate([prompt], params)[0]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """A tiny random Qwen3 (tests/support/tiny_models.py): the scheduling under test is the
    same for any model, and 64 prompts take seconds on it rather than tens of seconds."""
    return load_model(str(tiny_dir("qwen3")), dtype="float32", device="cpu")


def test_64_requests_under_preemption_match_the_batch_without_it_and_alone(tiny):
    lengths = [round(400 ** (i / 63)) for i in range(64)]  # 1 to 400, log-uniform
    prompts = [random_prompt(n, seed=i) for i, n in enumerate(lengths)]
    # 64 blocks hold 1,024 tokens; the prompts alone need 4,401 (the longest in 2 chunks)
    eng = Engine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=64))
    outputs = eng.generate(prompts, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    assert sum(c.times_preempted for o in outputs for c in o.choices) > 0
    eng.check()
    assert eng.blocks.referenced_blocks() == 0
    roomy = Engine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=600))
    expected = roomy.generate(prompts, GREEDY)
    assert roomy.scheduler.num_preemptions == 0
    for prompt, out, ref in zip(prompts, outputs, expected, strict=True):
        assert out.choices[0].token_ids == ref.choices[0].token_ids, f"{len(prompt)} tokens"
    # and each equals the request run by itself (batch invariance: test_determinism.py)
    for i in (0, 21, 42, 63):
        solo = alone(tiny, prompts[i], GREEDY).choices[0].token_ids
        assert outputs[i].choices[0].token_ids == solo, f"prompt of {lengths[i]} tokens"


def test_seeded_sampling_is_the_same_alone_or_among_31_others(tiny):
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    prompt = tiny.tokenizer.encode("Write one sentence about the sea.")
    solo = alone(tiny, prompt, params).choices[0].token_ids
    others = [
        (random_prompt(5 + 9 * i, seed=i), SamplingParams(max_tokens=8 + i, temperature=1.0))
        for i in range(31)
    ]
    prompts = [p for p, _ in others[:15]] + [prompt] + [p for p, _ in others[15:]]
    params_list = [q for _, q in others[:15]] + [params] + [q for _, q in others[15:]]
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=600))
    crowd = engine.generate(prompts, params_list)
    assert crowd[15].choices[0].token_ids == solo
    other_seed = alone(tiny, prompt, SamplingParams(**{**params.__dict__, "seed": 99}))
    assert other_seed.choices[0].token_ids != solo


def test_shared_prefix_computes_only_the_new_tokens(embedded, engine):
    prefix = random_prompt(512, seed=7)
    first = prefix + random_prompt(20, seed=8)
    second = prefix + random_prompt(37, seed=9)
    engine.generate([first], GREEDY)
    out = engine.generate([second], GREEDY)[0]
    assert out.num_cached_tokens == 512  # 32 full blocks
    assert out.num_computed_prompt_tokens == 37
    uncached = alone(embedded, second, GREEDY, enable_prefix_caching=False)
    assert uncached.num_cached_tokens == 0
    assert out.choices[0].token_ids == uncached.choices[0].token_ids


def test_stop_string_across_two_tokens_is_left_out(embedded, engine):
    tok = embedded.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0]
    assert full.choices[0].text == "The capital of France is Paris."
    assert not any("France is" in tok.decode([t]) for t in full.choices[0].token_ids)
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, stop=("France is",))
    )[0]
    choice = stopped.choices[0]
    assert choice.text == "The capital of "
    assert choice.finish_reason is FinishReason.STOP
    kept = engine.generate(
        [prompt],
        SamplingParams(
            max_tokens=20, temperature=0, stop=("France is",), include_stop_str_in_output=True
        ),
    )[0]
    assert kept.choices[0].text == "The capital of France is"


def test_streamed_text_never_takes_back_a_stop_string_prefix(embedded, engine):
    prompt = embedded.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    engine.add_request(
        EngineRequest("s", prompt, SamplingParams(max_tokens=20, temperature=0, stop=("Paris",)))
    )
    pieces = []
    while engine.has_unfinished:
        pieces += [d.text for d in engine.step()]
    assert "".join(pieces) == "The capital of France is "


def test_n_choices_share_the_prompt_blocks(embedded, engine):
    prompt = random_prompt(70, seed=3)  # 4 full blocks and 6 tokens
    engine.add_request(
        EngineRequest("n4", prompt, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=5))
    )
    seqs = engine.requests["n4"].seqs
    while not all(s.num_output_tokens >= 2 for s in seqs):
        engine.step()
    first_blocks = seqs[0].block_ids[:4]
    assert all(s.block_ids[:4] == first_blocks for s in seqs)
    assert [engine.blocks.blocks[b].ref_count for b in first_blocks] == [4, 4, 4, 4]
    assert len({s.block_ids[4] for s in seqs}) == 4  # the partial block is each one's own
    while engine.has_unfinished:
        engine.step()
    assert len({tuple(s.output_ids) for s in seqs}) > 1
    assert engine.blocks.referenced_blocks() == 0
    engine.check()


def test_pool_invariants_hold_at_every_step(embedded):
    eng = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=24))
    for i in range(10):
        eng.add_request(
            EngineRequest(f"r{i}", random_prompt(20 + 25 * i, seed=i), SamplingParams(max_tokens=6))
        )
    while eng.has_unfinished:
        eng.step()
        eng.check()
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.referenced_blocks() == 0


def test_abort_frees_blocks_at_once(embedded, engine):
    engine.add_request(
        EngineRequest("a", random_prompt(300, seed=1), SamplingParams(max_tokens=50))
    )
    engine.add_request(EngineRequest("b", random_prompt(40, seed=2), SamplingParams(max_tokens=50)))
    for _ in range(3):
        engine.step()
    assert engine.blocks.referenced_blocks() > 0
    deltas = engine.abort("a")
    assert [d.finish_reason for d in deltas] == [FinishReason.ABORT]
    assert "a" not in engine.requests
    engine.abort("b")
    assert engine.blocks.referenced_blocks() == 0
    assert not engine.scheduler.has_work
    engine.check()


@pytest.mark.parametrize(
    ("params", "prompt", "field"),
    [
        (SamplingParams(temperature=-0.1), [1, 2], "temperature"),
        (SamplingParams(top_p=0.0), [1, 2], "top_p"),
        (SamplingParams(top_p=1.5), [1, 2], "top_p"),
        (SamplingParams(top_k=-2), [1, 2], "top_k"),
        (SamplingParams(n=0), [1, 2], "n"),
        (SamplingParams(logprobs=21), [1, 2], "logprobs"),
        (SamplingParams(max_tokens=0), [1, 2], "max_tokens"),
        (SamplingParams(max_tokens=8000), [1] * 500, "max_tokens"),
        (SamplingParams(), [1, 49152], "prompt"),
        (SamplingParams(max_tokens=1), [1] * 8192, "prompt"),
        (SamplingParams(logit_bias={49152: 1.0}), [1, 2], "logit_bias"),
        (SamplingParams(stop=("",)), [1, 2], "stop"),
        (SamplingParams(), [], "prompt"),
    ],
)
def test_invalid_requests_are_refused_and_nothing_is_queued(engine, params, prompt, field):
    with pytest.raises(ValidationError) as err:
        engine.add_request(EngineRequest("bad", prompt, params))
    assert err.value.field == field
    assert not engine.requests and not engine.scheduler.has_work


def test_unknown_parameter_is_named():
    with pytest.raises(ValidationError) as err:
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 3})
    assert err.value.field == "best_of"
