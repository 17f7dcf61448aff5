"""Speculative decoding in the engine: with n-gram or suffix proposals every output is the one
the engine gives without them, token for token and logprob for logprob (greedy, seeded
sampling alone and in a batch of 32, stop strings, EOS and max_tokens inside an accepted run,
penalties, n > 1, grammars, preemption, a sequence arriving with output), in every dtype
`--dtype auto` may pick here; rejected tokens' blocks go back to the pool; the proposers'
indexes and the pool's rollback hold exact values."""

from __future__ import annotations

import json
import random

import pytest
import torch

from router.completions.structured import compile_grammar
from services.engine.block_manager import BlockManager
from services.engine.engine import Engine, EngineConfig
from services.engine.outputs import RequestOutput
from services.engine.params import SamplingParams
from services.engine.proposers import NgramIndex, OutputIndex, Proposal, SuffixLookup
from services.engine.request import EngineRequest, Sequence
from services.engine.speculative import accepted_run
from services.model.loader import LoadedModel, load_model
from services.settings import SpeculativeConfig
from tests.support.dtypes import COMPUTE_DTYPES

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
TEXTS = [
    CODE,
    "The cat sat on the mat. The dog sat on the log. The bird sat on the branch.",
    "red, green, blue, red, green, blue, red, green, blue",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY age;",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday",
    "for i in range(10):\n    print(i * i)\n",
    "To be, or not to be, that is the question.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
]
ASKS = ["Repeat this text exactly:", "Copy the following:", "Rewrite this, unchanged:",
        "Say it again:"]  # fmt: skip
# every running sequence speculates, whatever the batch (the default turns it off past 4)
NGRAM = SpeculativeConfig("ngram", num_tokens=4, max_batch=64)
SUFFIX = SpeculativeConfig("suffix", num_tokens=4, max_batch=64)


@pytest.fixture(scope="module", params=COMPUTE_DTYPES)
def model(request, embedded, embedded_dir) -> LoadedModel:
    if request.param == "float32":
        return embedded
    return load_model(str(embedded_dir), dtype=request.param, device="cpu")


def engine(model: LoadedModel, spec: SpeculativeConfig | None, num_blocks: int = 400) -> Engine:
    config = EngineConfig(num_blocks=num_blocks, speculative=spec or SpeculativeConfig())
    return Engine(model.model, model.tokenizer, config)


def grounded(model: LoadedModel, count: int) -> list[list[int]]:
    """Chat prompts asking to repeat a text: outputs that copy from the prompt."""
    return [
        model.tokenizer.encode_chat(
            [{"role": "user", "content": f"{ASKS[i % len(ASKS)]}\n{TEXTS[i % len(TEXTS)]}"}]
        )
        for i in range(count)
    ]


def random_prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(100, 49000, (int(n),), generator=g).tolist()
        for n in torch.randint(5, 60, (count,), generator=g)
    ]


def choices(outputs: list[RequestOutput]) -> list[list[tuple]]:
    return [
        [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.choices] for o in outputs
    ]


def idle(eng: Engine) -> None:
    eng.check()
    assert eng.blocks.referenced_blocks() == 0 and not eng.scheduler.has_work


def test_greedy_32_prompts_are_token_identical_with_speculation(model):
    prompts = grounded(model, 16) + random_prompts(16, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1)
    expected = choices(engine(model, None).generate(prompts, params))
    for spec in (NGRAM, SUFFIX):
        eng = engine(model, spec)
        assert choices(eng.generate(prompts, params)) == expected, spec.method
        assert eng.speculator is not None and eng.speculator.stats.accepted > 0
        idle(eng)


def test_seeded_sampling_is_the_same_alone_and_among_31_others(model):
    prompts = grounded(model, 16)
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(16)
    ]
    expected = choices(engine(model, None).generate(prompts, params))
    eng = engine(model, NGRAM)
    for i in (0, 5, 10, 15):  # 4 of them alone
        assert choices(eng.generate([prompts[i]], [params[i]]))[0] == expected[i], i
    others = random_prompts(16, seed=2)
    other_params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(16)]
    batch = choices(eng.generate(prompts + others, params + other_params))
    assert batch[:16] == expected
    assert eng.speculator is not None and eng.speculator.stats.accepted > 0
    idle(eng)


def regex_grammar() -> str:
    text, error = compile_grammar("regex", r"(def [a-z]+\(a, b\):\n    return a [+-] b\n\n\n?)+")
    assert not error
    return text


PARAMS = {
    "stop string": SamplingParams(max_tokens=40, temperature=0, stop=["return a - b"]),
    "stop kept": SamplingParams(
        max_tokens=40, temperature=0, stop=["sub"], include_stop_str_in_output=True
    ),
    "stop token": SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[1917]),
    "max_tokens": SamplingParams(max_tokens=7, temperature=0),
    "eos early": SamplingParams(max_tokens=60, temperature=0),
    "min_tokens": SamplingParams(max_tokens=60, temperature=0, min_tokens=40),
    "logprobs": SamplingParams(max_tokens=30, temperature=0, logprobs=3),
    "penalties": SamplingParams(
        max_tokens=30,
        temperature=0.7,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
    ),
    "n=3 seeded": SamplingParams(max_tokens=30, temperature=0.8, seed=9, n=3, logprobs=1),
    "grammar": SamplingParams(max_tokens=40, temperature=0, grammar=regex_grammar()),
    "logit bias": SamplingParams(max_tokens=30, temperature=0, logit_bias={578: 5.0}),
}


def test_every_sampling_feature_gives_the_same_output(model):
    """Every feature of PARAMS on the same 4 prompts, all in one batch of 52 sequences, each
    speculating (batch invariance lets the batch stand for each request alone)."""
    names = list(PARAMS)
    prompts = grounded(model, 4) * len(names)
    params = [PARAMS[name] for name in names for _ in range(4)]
    # room for every sequence at once: preemption has its own test below
    expected = choices(engine(model, None, num_blocks=1000).generate(prompts, params))
    eng = engine(model, SUFFIX, num_blocks=1000)
    got = choices(eng.generate(prompts, params))
    for i, name in enumerate(names):
        assert got[4 * i : 4 * i + 4] == expected[4 * i : 4 * i + 4], name
    assert eng.speculator is not None and eng.speculator.stats.accepted > 0
    idle(eng)


def test_preemption_and_heavy_rejection_change_nothing_and_leak_nothing(model):
    prompts = grounded(model, 8) + random_prompts(8, seed=3)
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=11, n=2)
    expected = choices(engine(model, None).generate(prompts, params))

    class Wrong:
        """Proposes 4 tokens the model all but never draws: nearly everything is rejected."""

        def __init__(self) -> None:
            self.rng = random.Random(0)

        def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
            return [Proposal([self.rng.randrange(30000, 49000) for _ in range(k)]) for k in ks]

        def finished(self, seq: Sequence) -> None:
            pass

    # 30 blocks: 480 tokens of KV for 32 sequences of up to ~100 tokens: preemption
    eng = engine(model, NGRAM, num_blocks=30)
    assert eng.speculator is not None
    eng.speculator.proposer = Wrong()
    assert choices(eng.generate(prompts, params)) == expected
    stats = eng.speculator.stats
    assert stats.proposed > 150 and stats.accepted < stats.proposed // 20
    assert eng.scheduler.num_preemptions > 0
    idle(eng)


def test_a_sequence_arriving_with_output_continues_the_same(model):
    """The prefill -> decode handoff and a migration: a request arriving with its first
    tokens continues exactly as the engine that generated them would have."""
    prompt = grounded(model, 1)[0]
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=21)
    whole = engine(model, None).generate([prompt], params)[0].choices[0].token_ids
    for cut in (1, 9):
        eng = engine(model, NGRAM)
        eng.add_request(EngineRequest("moved", prompt, params, output_ids=whole[:cut]))
        tokens = list(whole[:cut])
        while eng.has_unfinished:
            tokens += [t for d in eng.step() for t in d.token_ids]
        assert tokens == whole
        idle(eng)


def test_deltas_carry_every_accepted_token_and_text_once(embedded):
    eng = engine(embedded, NGRAM)
    prompt = grounded(embedded, 1)[0]
    params = SamplingParams(max_tokens=40, temperature=0, stop=["sub"])
    expected = engine(embedded, None).generate([prompt], params)[0].choices[0]
    eng.add_request(EngineRequest("r", prompt, params))
    deltas = []
    while eng.has_unfinished:
        deltas += eng.step()
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert max(len(d.token_ids) for d in deltas) > 1  # several tokens in one step
    assert [d.num_output_tokens for d in deltas][-1] == len(expected.token_ids)
    assert [d.finish_reason for d in deltas][-1] == expected.finish_reason


def test_speculation_is_off_past_max_batch(embedded):
    eng = engine(embedded, SpeculativeConfig("ngram", max_batch=3))
    eng.generate(grounded(embedded, 4), SamplingParams(max_tokens=12, temperature=0))
    assert eng.speculator is not None and eng.speculator.stats.steps == 0
    eng.generate(grounded(embedded, 3), SamplingParams(max_tokens=12, temperature=0))
    assert eng.speculator.stats.steps > 0


# -- the parts, exactly ------------------------------------------------------------------


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    index = NgramIndex(2, 4)
    index.extend(tokens, len(tokens) - 1)
    n, end = index.match(tokens)
    assert (n, end) == (3, 3)  # [1, 2, 3] at 0..2: the 3-gram beats [2, 3] at 5..6
    assert tokens[end : end + 4] == [4, 9, 2, 3]
    assert index.match([7, 8]) == (0, 0)
    tail_only = NgramIndex(2, 2)  # the tail itself is never indexed
    tail_only.extend([5, 6], 1)
    assert tail_only.match([5, 6]) == (0, 0)


def test_output_index_matches_recent_outputs_and_forgets_the_oldest():
    index = OutputIndex(min_n=2, max_n=3, capacity=10)
    index.add([1, 2, 3, 4, 5, 6])
    assert index.match([9, 2, 3], 3) == (2, [4, 5, 6])
    index.add([7, 8, 9, 10, 11])  # 11 tokens > 10: the first output goes
    assert [o.id for o in index.outputs] == [1] and index.size == 5
    assert index.match([2, 3], 3) == (0, [])
    assert index.match([8, 9], 3) == (2, [10, 11])
    assert all(i == 1 for i, _ in index.ends.values())


def test_suffix_lookup_prefers_the_longer_match():
    lookup = SuffixLookup(min_n=2, max_n=3, index_tokens=100)
    done = Sequence("a", 0, 2, [50, 51, 1, 2, 3, 40, 41], SamplingParams(), seed=0, arrival=0)
    lookup.finished(done)  # the output [1, 2, 3, 40, 41] and one prompt token before it
    seq = Sequence("b", 0, 3, [2, 3, 7, 9, 1, 2, 3], SamplingParams(), seed=0, arrival=1)
    assert lookup.propose([seq], [2])[0].tokens == [40, 41]  # [1, 2, 3] indexed: longer
    seq.token_ids.append(7)
    assert lookup.propose([seq], [2])[0].tokens == [9, 1]  # only its own [3, 7]


def test_accepted_run():
    assert accepted_run([5, 6, 7], [5, 6, 8, 9]) == 2
    assert accepted_run([5, 6], [5, 6, 1]) == 2
    assert accepted_run([5], [4, 1]) == 0


def test_truncate_frees_the_rejected_tail_to_be_reused_first():
    blocks = BlockManager(8, 4, "ns")
    seq = Sequence("a", 0, 5, list(range(5)), SamplingParams(), seed=0, arrival=0)
    blocks.allocate(seq, 5 + 6)  # 11 tokens: blocks 0, 1, 2
    assert seq.block_ids == [0, 1, 2]
    seq.num_computed_tokens = 6  # 6 of 11 kept: blocks 0 and 1
    blocks.truncate(seq)
    assert seq.block_ids == [0, 1]
    assert list(blocks.free) == [2, 3, 4, 5, 6, 7]
    blocks.check()


def test_adaptive_length_follows_acceptance(embedded):
    eng = engine(embedded, SpeculativeConfig("ngram", num_tokens=5))
    assert eng.speculator is not None
    seq = Sequence("a", 0, 1, [1, 2], SamplingParams(), seed=0, arrival=0)
    eng.speculator.verified(seq, proposed=5, accepted=1)
    assert seq.spec_length == 2
    eng.speculator.verified(seq, proposed=2, accepted=2)
    assert seq.spec_length == 3
    eng.speculator.verified(seq, proposed=3, accepted=0)
    assert seq.spec_length == 1
    assert (eng.speculator.stats.proposed, eng.speculator.stats.accepted) == (10, 3)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="not none, ngram, suffix, draft:MODEL or mtp"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError):
        SpeculativeConfig("ngram", num_tokens=0)
    assert json.dumps(NGRAM.method) == '"ngram"'
