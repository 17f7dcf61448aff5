"""What clients of OpenAI and vLLM rely on beyond the basics: GET /v1/models/{id}, best_of,
logprobs: 0, stream_options' rules and vLLM's continuous_usage_stats, and cached_tokens
counting only what was computed before the request arrived."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.support.cluster import MODEL


def test_retrieve_a_model(client, router):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_best_of_returns_the_best_by_cumulative_logprob(client):
    prompt = "Once upon a time"
    args = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=42)
    every = client.completions.create(**args, n=3, logprobs=0)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(**args, n=2, best_of=3)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all 3 generated


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ],
)
def test_best_of_and_stream_options_misuse_is_400(router, extra, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    r = httpx.post(f"{router.url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_logprobs_zero_gives_the_chosen_token(client):
    r = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, logprobs=0, temperature=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]


def test_continuous_usage_stats(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    counts = [c.usage.completion_tokens for c in stream if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 10 and len(counts) > 2
    assert all(k > 0 for k in counts)


def test_cached_tokens_count_only_what_was_there_before(client):
    prompt = f"{uuid.uuid4()} never seen before: " + "a story about the sea " * 8
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # choice 1 reused choice 0's
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=2)
    full_blocks = first.usage.prompt_tokens // 16 * 16
    assert again.usage.prompt_tokens_details.cached_tokens >= full_blocks - 16
