"""The OpenAI API through the router, with the official client (sync and async): shapes,
streams equal to whole answers, usage equal to the tokenizer's counts, and tokens equal to
one in-process engine's."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from services.engine.params import SamplingParams
from tests.support.cluster import MODEL, reference

PROMPT = "The three primary colors are"
MESSAGES = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


def collect(stream) -> tuple[dict[int, str], dict[int, list[str]], list, object]:
    """Text per choice, finish reasons per choice, the chunks, and the usage chunk's usage."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    chunks, usage = [], None
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if chunk.object == "text_completion" else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    return texts, finishes, chunks, usage


def test_greedy_completion_equals_the_engine(client, engine, embedded):
    ids = embedded.tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    expected = reference(engine, ids, SamplingParams(max_tokens=24, temperature=0))
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert [c.text for c in r.choices] == expected
    assert r.choices[0].finish_reason in ("stop", "length")
    completion = len(embedded.tokenizer.encode(expected[0]))
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens >= completion - 1  # re-encoding may merge tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_seeded_n2_completion_stream_equals_whole(client, engine, embedded):
    ids = embedded.tokenizer.encode(PROMPT)
    args = dict(
        model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0.9, top_p=0.95, n=2, seed=1234
    )
    whole = client.completions.create(**args)
    texts, finishes, _, usage = collect(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, n=2, seed=1234)
    expected = reference(engine, ids, params)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert [texts[0], texts[1]] == expected
    assert expected[0] != expected[1]  # two choices, two seeds
    assert all(len(f) == 1 for f in finishes.values()) and set(finishes) == {0, 1}
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_cuts_the_text(client, engine, embedded):
    ids = embedded.tokenizer.encode(PROMPT)
    greedy = reference(engine, ids, SamplingParams(max_tokens=24, temperature=0))[0]
    stop = greedy.split()[2]  # a word the greedy text reaches
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == greedy[: greedy.index(stop)]
    streamed, _, _, _ = collect(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True
        )
    )
    assert streamed[0] == r.choices[0].text


def test_prompt_forms_echo_and_logprobs(client, embedded):
    ids = embedded.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=8, temperature=0
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == by_text.choices[0].text
    assert two.usage.prompt_tokens == len(ids) + len(embedded.tokenizer.encode("Once upon a time"))
    echo = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True
    )
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text
    lp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == lp.usage.completion_tokens
    assert "".join(logprobs.tokens) == lp.choices[0].text
    assert logprobs.text_offset[0] == 0
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3 and value <= 0
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the top token
        assert token in top


def test_chat_whole_and_streamed(client, engine, embedded):
    ids = embedded.tokenizer.encode_chat(MESSAGES)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, logprobs=True, top_logprobs=2
    )
    expected = reference(engine, ids, SamplingParams(max_tokens=40, temperature=0))[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(ids)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token
        assert bytes(item.bytes) == item.token.encode()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, chunks, usage = collect(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert texts[0] == expected and finishes == {0: [r.choices[0].finish_reason]}
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == r.usage.completion_tokens


def test_usage_equals_the_tokenize_endpoint(client, router):
    counted = httpx.post(f"{router.url}/tokenize", json={"messages": MESSAGES}).json()
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0
    )
    assert r.usage.prompt_tokens == counted["count"]
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    back = httpx.post(f"{router.url}/detokenize", json={"tokens": counted["tokens"]}).json()
    assert back["prompt"].endswith("<|im_start|>assistant\n")


def test_async_client_concurrent_streams(router, engine, embedded):
    prompts = [f"Write a list of {k} fruits:" for k in range(2, 6)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(run())
    params = SamplingParams(max_tokens=20, temperature=0)
    assert texts == [reference(engine, embedded.tokenizer.encode(p), params)[0] for p in prompts]


def test_models_health_version_openapi(client, router):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(f"{router.url}/v1/models").json()["data"][0]
    assert raw["object"] == "model" and raw["owned_by"] == "pdserve"
    assert raw["max_model_len"] == 8192 and isinstance(raw["created"], int) and raw["root"]
    assert httpx.get(f"{router.url}/health").status_code == 200
    assert httpx.get(f"{router.url}/version").json()["version"]
    paths = httpx.get(f"{router.url}/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)
