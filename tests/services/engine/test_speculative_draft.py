"""Speculation with a draft model, on small random Llamas sharing the embedded tokenizer (a
64-token vocabulary): a draft equal to the target has every token accepted, greedy or sampled;
with a different draft, greedy outputs equal the engine's without speculation, and 10,000
sampled tokens at one position follow the target's distribution (rejection sampling);
the draft's own KV pool is empty once everything has finished."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers
from scipy.stats import chisquare

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.engine.proposers import DraftModel
from services.engine.request import EngineRequest
from services.model.loader import LoadedModel, load_model
from services.settings import SpeculativeConfig

VOCAB = 64
DRAFT = SpeculativeConfig("draft", num_tokens=3, max_batch=1024)


def llama(layers: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    return transformers.LlamaForCausalLM(config).eval()


def save(model: transformers.LlamaForCausalLM, path, embedded_dir):
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded_dir / f, path / f)
    return path


def checkpoints(tmp_path_factory, embedded_dir):
    """A random 2-layer target (its head scaled: distributions far from uniform) and a draft
    that is its first layer alone: related, as a real draft is, yet often wrong. Their
    directories, and the target in transformers."""
    torch.manual_seed(0)
    reference = llama(2)
    with torch.no_grad():
        reference.lm_head.weight.mul_(30)
    draft = llama(1)
    draft.load_state_dict(reference.state_dict(), strict=False)
    target_dir = save(reference, tmp_path_factory.mktemp("target"), embedded_dir)
    draft_dir = save(draft, tmp_path_factory.mktemp("draft"), embedded_dir)
    return target_dir, draft_dir, reference


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_dir):
    target_dir, draft_dir, reference = checkpoints(tmp_path_factory, embedded_dir)
    return (
        load_model(str(target_dir), dtype="float32", device="cpu"),
        load_model(str(draft_dir), dtype="float32", device="cpu"),
        reference,
    )


def engine(target: LoadedModel, draft: LoadedModel | None, spec=DRAFT, blocks=256) -> Engine:
    return Engine(
        target.model,
        target.tokenizer,
        EngineConfig(num_blocks=blocks, speculative=spec),
        draft=draft.model if draft else None,
    )


PROMPTS = [[5 + (i * 7 + j * 3) % 50 for j in range(10 + i)] for i in range(8)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_draft_equal_to_the_target_has_everything_accepted(models, temperature):
    target, _, _ = models
    eng = engine(target, target)
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=3, ignore_eos=True)
    eng.generate(PROMPTS, params)
    stats = eng.speculator.stats if eng.speculator else None
    assert stats is not None and stats.proposed > 50
    assert stats.accepted == stats.proposed


def test_greedy_with_another_draft_is_token_identical(models):
    target, draft, _ = models
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    expected = engine(target, None, spec=SpeculativeConfig()).generate(PROMPTS, params)
    eng = engine(target, draft)
    got = eng.generate(PROMPTS, params)
    key = [(c.token_ids, c.logprobs) for o in expected for c in o.choices]
    assert [(c.token_ids, c.logprobs) for o in got for c in o.choices] == key
    stats = eng.speculator.stats if eng.speculator else None
    assert stats is not None and 0 < stats.accepted < stats.proposed
    eng.check()
    assert isinstance(eng.speculator.proposer, DraftModel)
    assert eng.speculator.proposer.blocks.referenced_blocks() == 0
    assert not eng.speculator.proposer.states


def test_10000_drafted_draws_follow_the_targets_distribution(models):
    """The sequence arrives decoding (its prompt's block cached, one output token): the
    first step verifies one drafted token, whose kept value must be distributed as the
    target's p(. | prompt, output) whatever the draft proposed."""
    target, draft, reference = models
    prompt, first = [7 + (3 * j) % 40 for j in range(16)], 11
    with torch.no_grad():
        logits = reference(torch.tensor([[*prompt, first]])).logits[0, -1].double()
    p = torch.softmax(logits, dim=-1).numpy()
    eng = engine(target, draft, blocks=2048)
    eng.generate([[*prompt, first]], SamplingParams(max_tokens=1))  # caches the prompt block
    draws = 10_000
    for i in range(draws):
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True)
        eng.add_request(EngineRequest(f"r{i}", prompt, params, output_ids=[first]))
    tokens = []
    while eng.has_unfinished:
        tokens += [
            d.token_ids[0] for d in eng.step() if d.num_output_tokens - len(d.token_ids) == 1
        ]
    assert len(tokens) == draws
    stats = eng.speculator.stats if eng.speculator else None
    assert stats is not None and stats.steps >= draws and 0 < stats.accepted < stats.proposed
    counts = np.bincount(tokens, minlength=VOCAB)
    big = p * draws >= 5  # bins expected to hold at least 5, the rest pooled
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(p[big], p[~big].sum()) * draws
    assert chisquare(observed, expected).pvalue > 0.001
