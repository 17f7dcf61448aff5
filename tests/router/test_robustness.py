"""What clients throw at a running cluster (2 prefill + 2 decode worker processes behind a
router): a storm of streams cancelled after their first chunk, bad sampling parameters mixed
with good requests, clients that leave while their prompt computes, and steady load that
must not make a healthy worker look unhealthy.

What is asserted is what the workers did (their logs, their caches), never how fast: a
loaded machine is slower, not wrong. Deadlines only bound a hang."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from services.engine.params import SamplingParams
from services.launcher import RouterProcess, WorkerProcess
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params
from tests.support.cluster import (
    MODEL,
    addresses,
    load,
    log_events,
    log_size,
    logged,
    metrics,
    reference,
    wait_idle,
)

FLAP_SECONDS = float(os.environ.get("PDSERVE_FLAP_TEST_SECONDS", "12"))
FLAP_HEALTH_INTERVAL = 0.1  # 10 health checks of each worker a second: 120 in 12 s


@pytest.fixture
def fresh_router(pool, tmp_path):
    """A router of the test's own over the session's pool: its /metrics count only this test."""
    prefill, decode = pool
    router = RouterProcess(tmp_path, addresses(prefill), addresses(decode)).start()
    yield router
    router.stop()


def unhealthy_marks(router_url: str) -> dict[str, float]:
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in metrics(router_url).items()
        if name == "pdserve_worker_unhealthy_total"
    }


def test_200_streams_cancelled_after_their_first_chunk_leave_nothing_behind(
    pool, fresh_router, engine, embedded
):
    prefill, decode = pool
    url = f"{fresh_router.url}/v1/completions"

    async def storm(round_: int) -> int:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:

            async def first_chunk_then_leave(i: int) -> bool:
                body = {"model": MODEL, "prompt": f"Story {round_}.{i}: once upon a time",
                        "max_tokens": 200, "ignore_eos": True, "stream": True}  # fmt: skip
                async with http.stream("POST", url, json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            return "choices" in json.loads(line[6:])
                return False

            got = await asyncio.gather(*(first_chunk_then_leave(i) for i in range(200)))
            return sum(got)

    client = openai.OpenAI(base_url=f"{fresh_router.url}/v1", api_key="x", max_retries=0)
    prompt = "After the storm, the harbour was"
    expected = reference(
        engine, embedded.tokenizer.encode(prompt), SamplingParams(max_tokens=8, temperature=0)
    )[0]
    for round_ in range(2):
        since = [log_size(w) for w in decode]
        assert asyncio.run(storm(round_)) == 200
        idle = wait_idle([*prefill, *decode], timeout=300)  # only bounds a hang
        start = time.monotonic()
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, timeout=120
        )
        answered = time.monotonic() - start
        assert r.choices[0].text == expected
        # of the storm's streams that reached a decode worker none ran on to its 200th token:
        # the one Decode since the storm that ended with its last token is this answer's
        begun = logged(decode, since, "decode")
        finished = [rid for _, rid in logged(decode, since, "decoded")]
        assert len(begun) > 1 and len(finished) == 1 and finished[0].startswith(r.id), finished
        print(
            f"round {round_}: workers idle {idle:.2f}s after the storm ({len(begun) - 1} "
            f"decodes begun, none finished), answered in {answered:.2f}s"
        )
        gauges = metrics(fresh_router.url)
        assert gauges[("pdserve_requests_running", ())] == 0
        assert gauges[("pdserve_requests_waiting", ())] == 0
    assert not any(unhealthy_marks(fresh_router.url).values())


BAD = [  # (field, value): one out-of-range sampling parameter each
    ("top_k", 49153), ("top_k", 3_000_000_000), ("top_k", -2), ("temperature", 2.5),
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("min_p", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("logit_bias", {"60000": 1}), ("logit_bias", {"5": 200}), ("stop_token_ids", [60000]),
    ("logprobs", 21), ("n", 0), ("max_tokens", 0), ("min_tokens", 50), ("seed", 1 << 64),
    ("temperature", "hot"), ("stream", "yes"), ("max_tokens", 10_000),
]  # fmt: skip


def test_bad_parameters_are_refused_alone_and_good_requests_answer_exactly(
    pool, fresh_router, engine, embedded
):
    prompts = [f"Fact number {i} about the moon:" for i in range(10)]
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = {p: reference(engine, embedded.tokenizer.encode(p), params)[0] for p in prompts}
    url = f"{fresh_router.url}/v1/completions"

    def send(i: int) -> tuple[str, int, str]:
        body = {"model": MODEL, "prompt": prompts[i % 10], "max_tokens": 6, "temperature": 0}
        if i % 2:  # odd: one bad field
            field, value = BAD[(i // 2) % len(BAD)]
            body[field] = value
        response = httpx.post(url, json=body, timeout=60)
        return ("bad" if i % 2 else prompts[i % 10]), response.status_code, response.text

    with ThreadPoolExecutor(4) as pool_:
        results = list(pool_.map(send, range(100)))
    for kind, status, text in results:
        if kind == "bad":
            assert status == 400, text
            assert json.loads(text)["error"]["type"] == "invalid_request_error"
        else:
            assert status == 200, text
            assert json.loads(text)["choices"][0]["text"] == expected[kind]
    assert not any(unhealthy_marks(fresh_router.url).values())
    healthy = {
        dict(labels)["worker"]: value
        for (name, labels), value in metrics(fresh_router.url).items()
        if name == "pdserve_worker_healthy"
    }
    assert len(healthy) == 4 and all(healthy.values())


def leave_mid_prefill(router: RouterProcess, body: dict, prefill) -> tuple[WorkerProcess, float]:
    """Send `body` on a raw socket, hang up once a prefill worker runs it; that worker, and the
    seconds until every prefill worker reports it gone."""
    host, port = router.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        deadline = time.monotonic() + 60
        while not (running := [w for w in prefill if load(w).running]):
            assert time.monotonic() < deadline, "the prompt never started computing"
            time.sleep(0.01)
    left = time.monotonic()  # the socket is closed: the client is gone
    wait_idle(prefill, timeout=120)  # a prefill left running would end well within it too
    return running[0], time.monotonic() - left


def blocks_held(worker: WorkerProcess, prompt: list[int]) -> tuple[int, int]:
    """How many of the prompt's blocks the worker holds or its store has, of those it would
    look for: the `fetched` line a Prefill of the prompt logs before it computes anything
    (that Prefill is then cancelled)."""
    rid, since = f"probe-{uuid.uuid4().hex}", log_size(worker)

    async def probe() -> dict[str, str]:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            params = to_proto_params(SamplingParams(max_tokens=1))
            request = pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params)
            call = pbg.PrefillWorkerStub(channel).Prefill(request)
            deadline = time.monotonic() + 60
            try:
                while True:
                    for e in log_events(worker, since):
                        if e.get("msg") == "fetched" and e.get("request_id") == rid:
                            return e
                    assert time.monotonic() < deadline, "the probe fetched nothing"
                    await asyncio.sleep(0.02)
            finally:
                call.cancel()

    fetched = asyncio.run(probe())
    return int(fetched["cached"]) + int(fetched["blocks"]), int(fetched["of"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_mid_prefill_stops_its_prefill(pool, fresh_router, stream):
    prefill, decode = pool
    rng = random.Random(f"{time.time()}-{stream}")  # a fresh prompt: nothing cached anywhere
    prompt = [rng.randrange(100, 49000) for _ in range(4000)]  # seconds of prefill on 2 cores
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
    worker, seconds = leave_mid_prefill(fresh_router, body, prefill)
    held, of = blocks_held(worker, prompt)
    print(
        f"prefill gone {seconds * 1000:.0f} ms after the client left, {held} of {of} blocks "
        f"computed (stream={stream})"
    )
    assert held < of  # stopped part way: a prefill run to its end leaves every block behind
    wait_idle([*prefill, *decode], timeout=60)


def test_no_unhealthy_flap_under_steady_load(pool, tmp_path):
    """Two clients send prefill-heavy requests back to back for PDSERVE_FLAP_TEST_SECONDS
    (12 by default) to a router checking each worker's health 10 times a second (some 120
    checks of each, under load from the first second); no worker may be marked unhealthy,
    and every request succeeds."""
    prefill, decode = pool
    interval = ("--health-interval", str(FLAP_HEALTH_INTERVAL))
    router = RouterProcess(tmp_path, addresses(prefill), addresses(decode), *interval).start()
    try:
        outcomes, marks = steady_load(router.url)
    finally:
        router.stop()
    print(f"{len(outcomes)} requests in {FLAP_SECONDS:.0f}s; unhealthy marks: {marks}")
    assert [o for o in outcomes if o != "ok"] == []  # 7-9 here, 4 at least
    assert not any(marks.values()), marks


def steady_load(router_url: str) -> tuple[list[str], dict[str, float]]:
    """Two clients' requests for FLAP_SECONDS (two at least each, however slow the machine):
    each one's outcome, then the unhealthy marks."""
    url = f"{router_url}/v1/completions"
    stop = time.monotonic() + FLAP_SECONDS
    outcomes: list[str] = []  # "ok", or what went wrong

    def client(k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(timeout=120) as http:
            sent = 0
            while sent < 2 or time.monotonic() < stop:
                sent += 1
                prompt = [rng.randrange(100, 49000) for _ in range(rng.randrange(200, 1200))]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "ignore_eos": True,
                        "stream": True}  # fmt: skip
                with http.stream("POST", url, json=body) as response:
                    lines = [line for line in response.iter_lines() if line]
                events = [json.loads(x[6:]) for x in lines[:-1] if x.startswith("data: ")]
                errors = [e["error"] for e in events if "error" in e]
                ok = response.status_code == 200 and lines[-1] == "data: [DONE]" and not errors
                outcomes.append("ok" if ok else f"{response.status_code}: {errors or lines[-3:]}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, unhealthy_marks(router_url)
