"""Structured output in the engine (float32, the embedded model): the mask allows exactly the
grammar's tokens, constrained outputs validate through n > 1, preemption and the prefill ->
decode handoff (a sequence arriving with output already generated continues as if it had
never moved), and bad grammars are refused with nothing queued."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch

from router.completions.structured import compile_grammar
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams, ValidationError
from services.engine.request import EngineRequest
from services.engine.structured import apply_mask, unpack
from services.model.loader import load_model
from tests.support.dtypes import COMPUTE_DTYPES

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=COMPUTE_DTYPES)
def model(request, embedded, embedded_dir):
    """The embedded model in every dtype `--dtype auto` may pick here: the guarantees below
    (preemption and the handoff change no token) hold in each."""
    if request.param == "float32":
        return embedded
    return load_model(str(embedded_dir), dtype=request.param, device="cpu")


def grammar(kind: str, spec: object, compact: bool = False) -> str:
    text, error = compile_grammar(
        kind, spec if isinstance(spec, str) else json.dumps(spec), compact
    )
    assert not error, error
    return text


def chat(embedded, text: str) -> list[int]:
    ids: list[int] = embedded.tokenizer.encode_chat([{"role": "user", "content": text}])
    return ids


def test_the_mask_allows_exactly_the_grammars_tokens(embedded):
    eng = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=8))
    choices = ["yes", "no", "maybe not"]
    m = eng.grammars.matcher(grammar("choice", choices), [])
    x = torch.zeros(2, embedded.model.config.vocab_size)
    eng.grammars.mask(x, [1], [m])
    assert torch.all(x[0] == 0)  # rows not named are left alone
    allowed = torch.nonzero(x[1] == 0).flatten().tolist()
    texts = [embedded.tokenizer.decode([t], skip_special_tokens=False) for t in allowed]
    assert sorted(texts) == sorted({t for t in texts if any(c.startswith(t) for c in choices)}), (
        "every allowed token begins a choice"
    )
    assert {"yes", "no"} <= set(texts)
    assert torch.isinf(x[1]).sum() == x.shape[1] - len(allowed)


def test_the_mask_kernel_equals_its_reference():
    vocab, words = 1000, 32  # 1,024 bits: the last word's tail is past the vocabulary
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    bits[1, 5:9] = -1  # whole words allowed
    bits[2] = 0  # nothing allowed
    x = torch.randn(5, vocab + 8, generator=gen)
    rows = torch.tensor([4, 0, 2])
    mine, ref = x.clone(), x.clone()
    apply_mask(mine, rows, bits, vocab)
    apply_mask(ref, rows, bits, vocab, use_kernel=False)
    assert torch.equal(mine, ref)
    assert torch.equal(mine[[1, 3]], x[[1, 3]])  # other rows untouched
    assert torch.isinf(mine[2]).all() and torch.isinf(mine[:, vocab:][rows]).all()
    kept = unpack(bits, vocab).bool()
    assert torch.equal(mine[rows, :vocab][kept], x[rows, :vocab][kept])


def test_outputs_validate_with_n_and_under_preemption(model):
    # compact: SCHEMA's longest value is ~35 tokens without whitespace, so every choice ends
    # within max_tokens whatever it samples (with whitespace, runs of it between tokens can
    # outlast 60: a bfloat16 choice on an AMX Xeon did)
    g = grammar("json", SCHEMA, compact=True)
    prompts = [chat(model, f"Describe item {k} as JSON.") for k in range(12)]
    # 24 blocks: 384 tokens of KV for 12 prompts of ~40 tokens x 3 choices: preemption
    eng = Engine(model.model, model.tokenizer, EngineConfig(num_blocks=24))
    params = SamplingParams(max_tokens=60, temperature=0.9, seed=5, n=3, grammar=g)
    outputs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    for out in outputs:
        for c in out.choices:
            assert c.finish_reason.value == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    eng.check()
    assert eng.blocks.referenced_blocks() == 0
    # the same seeds without preemption: the same tokens
    roomy = Engine(model.model, model.tokenizer, EngineConfig(num_blocks=400))
    again = roomy.generate(prompts, params)
    assert [[c.token_ids for c in o.choices] for o in again] == [
        [c.token_ids for c in o.choices] for o in outputs
    ]


def test_a_sequence_arriving_with_output_continues_under_its_grammar(model):
    """The prefill -> decode handoff and a migration: the matcher is rebuilt over the output."""
    g = grammar("json", SCHEMA)
    prompt = chat(model, "An item as JSON, please.")
    params = SamplingParams(max_tokens=60, temperature=0.7, seed=9, grammar=g)
    whole = Engine(model.model, model.tokenizer, EngineConfig(num_blocks=64))
    expected = whole.generate([prompt], params)[0].choices[0].token_ids
    for cut in (1, 7):
        eng = Engine(model.model, model.tokenizer, EngineConfig(num_blocks=64))
        eng.add_request(EngineRequest("moved", prompt, params, output_ids=expected[:cut]))
        seq = eng.requests["moved"].seqs[0]
        while eng.has_unfinished:
            eng.step()
        assert seq.output_ids == expected


def test_bad_grammars_are_refused_with_nothing_queued(embedded):
    eng = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=8))
    prompt = chat(embedded, "hi")
    bad = llguidance.LLMatcher.grammar_from_lark("start: nowhere")
    with pytest.raises(ValidationError) as e:
        eng.add_request(EngineRequest("a", prompt, SamplingParams(grammar=bad)))
    assert e.value.field == "grammar"
    yes_no = grammar("choice", ["yes", "no"])
    off_grammar = embedded.tokenizer.encode("maybe", add_special_tokens=False)
    with pytest.raises(ValidationError) as e:
        eng.add_request(
            EngineRequest("b", prompt, SamplingParams(grammar=yes_no), output_ids=off_grammar)
        )
    assert e.value.field == "output_token_ids"
    assert not eng.has_unfinished and not eng.scheduler.waiting
