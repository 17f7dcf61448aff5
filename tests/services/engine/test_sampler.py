"""The sampler: exact distributions, seeded determinism, penalties and masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from services.engine.params import SamplingParams
from services.engine.request import Sequence
from services.engine.sampler import Sampler, uniforms

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 20_000


def seq(params, seed=0, prompt=(1, 2, 3), output=()):
    tokens = [*prompt, *output]
    return Sequence("r", 0, len(prompt), tokens, params, seed, 0)


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def expected(params: SamplingParams) -> np.ndarray:
    """The analytic distribution, computed independently of the implementation."""
    p = softmax(LOGITS.double().numpy() / params.temperature)
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, dtype=bool)
    if params.top_k > 0:
        keep[order[params.top_k :]] = False
    if params.top_p < 1:
        q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        mass_before = np.cumsum(q[order]) - q[order]
        keep[order[mass_before >= params.top_p]] = False
    p = np.where(keep, p, 0)
    p = p / p.sum()
    if params.min_p > 0:
        p = np.where(p >= params.min_p * p.max(), p, 0)
        p = p / p.sum()
    return p


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.3, min_p=0.2),
    ],
    ids=["temperature", "top_k", "top_p", "min_p"],
)
def test_draws_follow_the_analytic_distribution(params):
    sampler = Sampler(len(LOGITS), eos_token_ids=())
    seqs = [seq(params, seed=i) for i in range(DRAWS)]
    tokens = sampler(LOGITS.expand(DRAWS, -1).clone(), seqs).token_ids
    counts = np.bincount(tokens, minlength=len(LOGITS))
    p = expected(params)
    assert counts[p == 0].sum() == 0, "a filtered-out token was drawn"
    support = p > 0
    result = chisquare(counts[support], DRAWS * p[support])
    assert result.pvalue > 0.001, (counts, DRAWS * p)


def test_uniforms_depend_on_seed_and_position_only():
    a = uniforms([5, 6, 5], [10, 10, 11])
    b = uniforms([5], [10])
    assert a[0] == b[0] and len({a[0].item(), a[1].item(), a[2].item()}) == 3
    assert ((a >= 0) & (a < 1)).all()


def test_a_row_draws_the_same_whatever_its_batch():
    sampler = Sampler(len(LOGITS), eos_token_ids=())
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=5)
    alone = sampler(LOGITS[None].clone(), [seq(p, seed=42)]).token_ids[0]
    crowd = [seq(SamplingParams(temperature=t), seed=i) for i, t in enumerate((0.5, 1.0, 2.0))]
    crowd.insert(2, seq(p, seed=42))
    batch = LOGITS.expand(4, -1).clone()
    assert sampler(batch, crowd).token_ids[2] == alone


def test_a_row_without_top_p_draws_the_same_beside_one_with_it():
    """Top-p draws over the vocabulary sorted by probability; a row without it must still
    draw in vocabulary order when a top-p row shares its batch (its seeded answer would
    otherwise depend on its neighbours: found by MTP drafting, whose verify steps batch
    differently). Logits out of order, 50 seeds: tokens and distributions equal exactly."""
    sampler = Sampler(50, eos_token_ids=())
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    plain, nucleus = SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9)
    for seed in range(50):
        rows = [seq(plain, seed=seed), seq(nucleus, seed=seed + 100)]
        together = sampler(logits.expand(2, -1).clone(), rows).token_ids
        assert together[0] == sampler(logits[None].clone(), rows[:1]).token_ids[0]
        assert together[1] == sampler(logits[None].clone(), rows[1:]).token_ids[0]
    both = sampler.distributions(logits.expand(2, -1).clone(), rows, [(), ()])
    assert torch.equal(both[0], sampler.distributions(logits[None].clone(), rows[:1], [()])[0])
    assert torch.equal(both[1], sampler.distributions(logits[None].clone(), rows[1:], [()])[0])


def test_greedy_and_logprobs():
    sampler = Sampler(len(LOGITS), eos_token_ids=())
    out = sampler(LOGITS[None].clone(), [seq(SamplingParams(temperature=0, logprobs=2))])
    assert out.token_ids == [0]
    lp = out.logprobs[0]
    logp = torch.log_softmax(LOGITS, -1)
    assert lp.token_id == 0 and math.isclose(lp.logprob, logp[0].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [0, 1]
    assert math.isclose(lp.top[1][1], logp[1].item(), rel_tol=1e-6)


def test_penalties():
    sampler = Sampler(4, eos_token_ids=())
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    s = seq(
        SamplingParams(
            temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
        ),
        prompt=(3,),
        output=(0, 0, 1),
    )
    processed = sampler._process(logits, [s], [s.params], [()])
    # token 0: 2/2 (repetition) - 0.25*2 - 0.5 = 0.0; token 1: -1*2 - 0.25 - 0.5 = -2.75
    # token 2: unseen, 1.0; token 3: in the prompt only, 0.5/2 = 0.25
    assert processed.tolist() == [[0.0, -2.75, 1.0, 0.25]]
    assert sampler(logits, [s]).token_ids == [2]


def test_a_row_with_tokens_ahead_is_the_sequence_with_them_appended():
    """Speculative decoding's rows: position (the seeded draw), penalties and min_tokens are
    those of the sequence with the proposed tokens appended."""
    sampler = Sampler(len(LOGITS), eos_token_ids=(0,))
    params = [
        SamplingParams(temperature=0.9, seed=4),
        SamplingParams(temperature=0, presence_penalty=2.0, repetition_penalty=1.5),
        SamplingParams(temperature=0, min_tokens=3),
        SamplingParams(temperature=1.0, top_p=0.7, frequency_penalty=0.7, logprobs=2),
    ]
    for p in params:
        for k in range(40):
            ahead = (k % 3, 1, 0)[: k % 4]
            base = seq(p, seed=k, output=(2,))
            grown = seq(p, seed=k, output=(2, *ahead))
            logits = torch.stack([LOGITS, LOGITS.flip(0)])
            rows = sampler(logits.clone(), [base, base], [(), ahead])
            alone = sampler(logits[1:].clone(), [grown])
            assert rows.token_ids[1:] == alone.token_ids and rows.logprobs[1:] == alone.logprobs


def test_logit_bias_and_min_tokens():
    sampler = Sampler(len(LOGITS), eos_token_ids=(0,))
    biased = seq(SamplingParams(temperature=0, logit_bias={7: 100.0}))
    assert sampler(LOGITS[None].clone(), [biased]).token_ids == [7]
    early = seq(SamplingParams(temperature=0, min_tokens=2), output=(4,))
    assert sampler(LOGITS[None].clone(), [early]).token_ids == [1]  # EOS (0) masked
    late = seq(SamplingParams(temperature=0, min_tokens=2), output=(4, 4))
    assert sampler(LOGITS[None].clone(), [late]).token_ids == [0]
    ignoring = seq(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), output=(4,))
    assert sampler(LOGITS[None].clone(), [ignoring]).token_ids == [0]
