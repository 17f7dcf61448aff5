"""Worker faults hidden from clients: a decode worker SIGKILLed mid-stream (the stream goes on
elsewhere, token-identical), a prefill worker SIGKILLed (the other serves), the KV store
down (decode workers prefill locally), the last decode worker lost (an error event, then
[DONE]), and a client that goes away (its decode is cancelled, the workers free everything)."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest

from services.engine.params import SamplingParams
from services.launcher import RouterProcess, WorkerProcess
from tests.support.cluster import (
    MODEL,
    addresses,
    load,
    log_size,
    logged,
    metrics,
    reference,
    start_workers,
    wait_idle,
    wait_until,
)
from tests.support.redis_servers import RedisServer

PROMPT = "Here is a long story about a lighthouse keeper and the sea."


@pytest.fixture(scope="module")
def faulty(embedded_dir, tmp_path_factory):
    """2 prefill + 2 decode workers on a redis-server of this module's own (it is killed)."""
    logs = tmp_path_factory.mktemp("fault-logs")
    redis = RedisServer(logs / "redis").start()
    try:
        args = ("--num-blocks", "300", "--store-timeout", "0.5")
        prefill, decode = start_workers(str(embedded_dir), redis.url, logs, 2, 2, *args)
        router = RouterProcess(
            logs,
            addresses(prefill),
            addresses(decode),
            "--policy",
            "round_robin",
            "--health-interval",
            "0.5",
        )
        try:
            yield redis, prefill, decode, router.start()
        finally:
            router.stop()
            for w in (*prefill, *decode):
                w.stop()
    finally:
        redis.stop()


def client_of(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


def test_structured_stream_survives_its_decode_worker_killed(faulty):
    """The new decode worker rebuilds the grammar's state from the tokens already sent: the
    output still validates (runs before the test below takes a decode worker away)."""
    _, _, decode, router = faulty
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "chapters": {
                "type": "array",
                "minItems": 6,
                "maxItems": 6,
                "items": {"type": "string", "minLength": 10, "maxLength": 40},
            },
        },
        "required": ["title", "chapters"],
        "additionalProperties": False,
    }
    stream = client_of(router).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT + " Outline it as JSON."}],
        max_tokens=400,
        temperature=0.8,
        seed=11,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "outline", "schema": schema},
        },
    )
    read = read_killing_its_decode_worker(stream, decode, lambda c: c.delta.content or "")
    text = read.text
    assert read.finishes == ["stop"], text
    jsonschema.validate(json.loads(text), schema)
    read.killed.start()  # back (same port) for the test below


@dataclass
class Read:
    text: str
    finishes: list[str]
    usage: object
    killed: WorkerProcess


def read_killing_its_decode_worker(stream, decode, piece) -> Read:
    """A stream read to its end, the decode worker serving it SIGKILLed at the 10th chunk;
    `piece` is a choice's new text."""
    text, killed, usage, finishes = "", None, None, []
    for i, chunk in enumerate(stream):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += piece(c)
            finishes += [c.finish_reason] if c.finish_reason else []
        if i == 10:
            serving = [w for w in decode if load(w).running == 1]
            assert len(serving) == 1, "the stream runs on exactly one decode worker"
            killed = serving[0]
            killed.process.send_signal(signal.SIGKILL)
            killed.process.wait()
    assert killed is not None and killed.process.returncode == -signal.SIGKILL
    return Read(text, finishes, usage, killed)


def test_decode_worker_killed_mid_stream(faulty, engine, embedded):
    _, _, decode, router = faulty
    ids = embedded.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    expected = reference(engine, ids, params)[0]
    stream = client_of(router).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=120,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    read = read_killing_its_decode_worker(stream, decode, lambda c: c.text)
    assert read.finishes == ["length"]
    assert read.text == expected  # no gap, no duplicate
    assert read.usage.completion_tokens == 120
    decode.remove(read.killed)
    read.killed.process = None


def test_prefill_worker_killed(faulty, engine, embedded):
    _, prefill, _, router = faulty
    victim = prefill.pop(0)
    victim.stop(signal.SIGKILL)
    client = client_of(router)
    params = SamplingParams(max_tokens=8, temperature=0)
    for k in range(4):  # round robin: the router tries the dead one before it learns
        prompt = f"{PROMPT} Chapter {k}:"
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == reference(engine, embedded.tokenizer.encode(prompt), params)[0]


def test_kv_store_down_decode_workers_prefill(faulty, engine, embedded):
    redis, _, _, router = faulty
    redis.kill()
    try:
        prompt = f"{PROMPT} With the store gone:"
        r = client_of(router).completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0
        )
        params = SamplingParams(max_tokens=8, temperature=0)
        assert r.choices[0].text == reference(engine, embedded.tokenizer.encode(prompt), params)[0]
        down = ("pdserve_local_prefills_total", (("reason", "kv_store_down"),))
        assert metrics(router.url)[down] == 1
    finally:
        redis.start()


def test_last_decode_worker_lost_is_an_error_event_then_done(faulty, embedded_dir, tmp_path):
    redis, prefill, _, _ = faulty
    lone = WorkerProcess("decode", str(embedded_dir), redis.url, tmp_path, dtype="float32").start()
    # a request waits --retry-wait seconds for a lost worker to come back: not here
    router = RouterProcess(tmp_path, addresses(prefill), [lone.address], "--retry-wait", "1")
    router.start()
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
                "stream": True}  # fmt: skip
        events = []
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 5:
                    lone.stop(signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "decode" in error["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])
    finally:
        router.stop()
        lone.stop()


def test_client_disconnect_cancels_the_decode_and_frees_the_workers(pool, router):
    prefill, decode = pool
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True,
            "stream": True}  # fmt: skip
    since = [log_size(w) for w in decode]
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 10:
                assert sum(load(w).running for w in decode) == 1
                break
    ended = wait_until(lambda: logged(decode, since, "decoded", "cancelled"), timeout=120)
    assert [msg for msg, _ in ended] == ["cancelled"]  # not run on to its 300th token
    seconds = wait_idle([*prefill, *decode], timeout=60)
    print(f"workers idle {seconds * 1000:.0f} ms after the client left")


def test_prefill_timeout_is_retried_then_503_when_none_is_left(faulty, embedded_dir, tmp_path):
    redis, prefill, decode, _ = faulty
    hung = WorkerProcess("prefill", str(embedded_dir), redis.url, tmp_path, dtype="float32").start()
    args = ("--policy", "round_robin", "--prefill-timeout", "1", "--health-interval", "60",
            "--retry-wait", "1")  # fmt: skip
    both = RouterProcess(tmp_path, [hung.address, prefill[-1].address], addresses(decode), *args)
    only_hung = RouterProcess(tmp_path, [hung.address], addresses(decode), *args)
    try:
        both.start()  # both see it healthy; it is not asked again for a minute
        only_hung.start()
        hung.process.send_signal(signal.SIGSTOP)  # now it answers nothing and closes nothing
        client = client_of(both)
        for k in range(2):  # round robin: one of the two goes to the hung worker first
            r = client.completions.create(model=MODEL, prompt=f"Try {k}", max_tokens=2)
            assert r.usage.completion_tokens == 2
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        response = httpx.post(f"{only_hung.url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert "prefill" in response.json()["error"]["message"]
    finally:
        both.stop()
        only_hung.stop()
        hung.process.send_signal(signal.SIGCONT)
        hung.stop()
