"""Speculative decoding through the whole path: `pdserve up --speculative suffix` (prefill and
decode processes, float32) answers 32 greedy prompts and seeded n=2 streams with exactly the
engine's tokens without speculation, the usage unchanged; a decode worker's /metrics counts
what it proposed and accepted; a decode worker with a draft model; bad settings refused."""

from __future__ import annotations

import asyncio
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from services.engine.params import SamplingParams
from services.launcher import PDSERVE, WorkerProcess, free_port
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params
from tests.services.engine.test_speculative import TEXTS, random_prompts
from tests.support.up import Up

MODEL = "SmolLM2-135M-Instruct"
ASK = "Repeat this text exactly:\n{}"


@pytest.fixture(scope="module")
def speculating(tmp_path_factory):
    kv = tmp_path_factory.mktemp("spec-kv")
    metrics = free_port()
    out = Up("--port", str(free_port()), "--kv-store", f"local://{kv}", "--num-blocks", "512",
             "--no-colocated", "--dtype", "float32", "--speculative", "suffix",
             "--speculative-max-batch", "64", "--metrics-port", str(metrics))  # fmt: skip
    try:  # worker 1, the decode worker, serves its metrics on the port after the prefill's
        yield openai.OpenAI(base_url=out.ready(), api_key="none", max_retries=0), metrics + 1
    finally:
        out.stop()


def test_32_greedy_prompts_equal_the_engine_without_speculation(speculating, engine):
    client, metrics = speculating
    questions = [ASK.format(TEXTS[i % len(TEXTS)]) + f" ({i})" for i in range(16)]
    token_prompts = random_prompts(16, seed=5)
    tok = engine.tokenizer
    chats = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = [o.choices[0] for o in engine.generate(chats + token_prompts, params)]

    def chat(q: str) -> tuple[str, int]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0
        )
        assert r.usage is not None
        return r.choices[0].message.content or "", r.usage.completion_tokens

    def complete(p: list[int]) -> tuple[str, int]:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
        assert r.usage is not None
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(chat, questions)) + list(pool.map(complete, token_prompts))
    assert got == [(c.text, len(c.token_ids)) for c in expected]
    scraped = httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
    pattern = r'^(pdserve_spec_\w+)_total\{role="decode"\} (\S+)$'
    counts = {name: float(value) for name, value in re.findall(pattern, scraped, re.M)}
    assert counts["pdserve_spec_accepted_tokens"] > 0
    assert counts["pdserve_spec_proposed_tokens"] >= counts["pdserve_spec_accepted_tokens"]


def test_seeded_streams_with_n_equal_the_engine(speculating, engine):
    client, _ = speculating
    question = ASK.format(TEXTS[0])
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": question}])
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=77, n=2)
    expected = [c.text for c in engine.generate([prompt], params)[0].choices]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=40,
        temperature=0.8,
        top_p=0.9,
        seed=77,
        n=2,
        stream=True,
    )
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == expected


def test_a_decode_worker_speculating_with_a_draft_model(embedded_dir, tmp_path, engine):
    """`--speculative draft:MODEL` (the draft here: the target itself, so every proposed
    token is accepted): a locally prefilled greedy stream equals the engine's, and the
    worker's counters say every proposal was kept."""
    metrics = free_port()
    worker = WorkerProcess(
        "decode", str(embedded_dir), "memory://", tmp_path, "--num-blocks", "128",
        "--speculative", f"draft:{embedded_dir}", "--metrics-port", str(metrics),
        dtype="float32",
    ).start()  # fmt: skip
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": ASK.format(TEXTS[2])}])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def decode() -> list[int]:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = pbg.DecodeWorkerStub(channel)
            request = pb.DecodeRequest(
                request_id="d",
                prompt_token_ids=prompt,
                params=to_proto_params(params),
                local_prefill=True,
            )
            return [t async for chunk in stub.Decode(request) for t in chunk.token_ids]

    try:
        tokens = asyncio.run(decode())
        scraped = httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
    finally:
        worker.stop()
    assert tokens == engine.generate([prompt], params)[0].choices[0].token_ids
    pattern = r'^(pdserve_spec_\w+)_total\{role="decode"\} (\S+)$'
    counts = {name: float(value) for name, value in re.findall(pattern, scraped, re.M)}
    assert counts["pdserve_spec_proposed_tokens"] > 10
    assert counts["pdserve_spec_accepted_tokens"] == counts["pdserve_spec_proposed_tokens"]


@pytest.mark.parametrize("value", ["eagle", "draft", "draft:", "ngram:x", "mtp:x"])
def test_a_bad_speculative_setting_is_refused_before_the_model_loads(value, tmp_path):
    result = subprocess.run(
        [PDSERVE, "decode", "--speculative", value, "--kv-store", "memory://"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"speculative: {value!r} is not none, ngram, suffix, draft:MODEL or mtp" in result.stderr
