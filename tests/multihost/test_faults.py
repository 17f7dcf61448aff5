"""Faults of hosts and links on the bed, hidden from clients: a decode host's link cut
mid-stream (the stream migrates, token-identical), the Redis host unreachable (workers
compute), a prefill host slowed to a trickle (its Prefill times out and is retried
elsewhere), and every decode host cut off (a request waits for one to come back, then 503).

Each test restores what it cut and waits until the router sees every worker again."""

from __future__ import annotations

import threading
import time

import httpx
import openai

from services.engine.params import SamplingParams
from tests.multihost.conftest import LINK, ROUTER_ARGS
from tests.support.bed_stack import BedStack
from tests.support.cluster import MODEL, load, log_events, log_size, metrics, reference, wait_until
from tests.support.netbed import Link
from tests.support.up import stream_completion

PROMPT = "Here is a long story about a lighthouse keeper and the sea."
RETRY_WAIT = float(ROUTER_ARGS[ROUTER_ARGS.index("--retry-wait") + 1])
PREFILL_TIMEOUT = float(ROUTER_ARGS[ROUTER_ARGS.index("--prefill-timeout") + 1])


def client_of(stack: BedStack) -> openai.OpenAI:
    assert stack.router is not None
    return openai.OpenAI(base_url=f"{stack.router.url}/v1", api_key="x", max_retries=0)


def healthy(stack: BedStack) -> dict[str, float]:
    """The router's pdserve_worker_healthy per worker address."""
    assert stack.router is not None
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in metrics(stack.router.url).items()
        if name == "pdserve_worker_healthy"
    }


def wait_whole(stack: BedStack) -> None:
    """Until the router counts every worker healthy again."""
    wanted = {w.address for w in stack.workers}
    wait_until(lambda: {a for a, v in healthy(stack).items() if v == 1} >= wanted, timeout=60)


def router_lines(stack: BedStack, since: int, msg: str) -> list[dict[str, str]]:
    assert stack.router is not None
    return [e for e in log_events(stack.router, since) if e.get("msg") == msg]


def test_decode_host_link_cut_mid_stream_migrates(bed_stack, engine, embedded):
    """The serving decode host's cable pulled after 4 chunks: no reset reaches anyone; the
    router's keepalive finds the link dead, and the stream goes on on the other decode host
    with every token the engine gives, none twice."""
    stack = bed_stack
    since = log_size(stack.router)
    args = dict(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    cut: list[str] = []

    def pull_the_cable() -> None:
        (serving,) = [w for w in stack.decode if load(w).running]
        stack.bed.cut(serving.host)
        cut.append(serving.host)

    start = time.monotonic()
    try:
        text, finishes = stream_completion(client_of(stack), args, 4, pull_the_cable)
    finally:
        for host in cut:
            stack.bed.restore(host)
    ids = embedded.tokenizer.encode(PROMPT)
    expected = reference(engine, ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert (text, finishes) == (expected[0], ["length"])
    (moved,) = router_lines(stack, since, "decode worker lost mid-stream: migrating")
    lost = next(w for w in stack.decode if w.host == cut[0])
    assert moved["worker"] == lost.address and int(moved["tokens_sent"]) >= 4
    assert time.monotonic() - start < 40  # found dead by keepalive, not by a TCP timeout
    wait_whole(stack)


def test_redis_host_unreachable_workers_compute(bed_stack, engine, embedded):
    """The Redis host cut off: the prefill worker's writes time out (store_timeout 1 s), the
    decode worker computes the prompt; the answer is the engine's."""
    stack = bed_stack
    assert stack.router is not None
    prompt = "Write down four facts about copper, with one sentence on each of them."
    local = ("pdserve_local_prefills_total", (("reason", "kv_store_down"),))
    before = metrics(stack.router.url).get(local, 0)
    stack.bed.cut("redis")
    try:
        start = time.monotonic()
        r = client_of(stack).completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, timeout=60
        )
        took = time.monotonic() - start
    finally:
        stack.bed.restore("redis")
    ids = embedded.tokenizer.encode(prompt)
    assert [c.text for c in r.choices] == reference(
        engine, ids, SamplingParams(max_tokens=16, temperature=0)
    )
    assert metrics(stack.router.url)[local] == before + 1
    assert took < 15
    wait_whole(stack)


def test_prefill_host_trickle_is_retried_elsewhere(bed_stack, engine, embedded):
    """The prefill host holding a long prompt's prefix slowed to 1 kbit/s: the router still
    sends it the prompt (it has the prefix), the Prefill does not finish within
    --prefill-timeout, and the other prefill host computes it; the answer is the engine's."""
    stack = bed_stack
    words = " ".join(f"item{i} is on shelf {i % 7}." for i in range(180))
    first = client_of(stack).completions.create(
        model=MODEL, prompt=words, max_tokens=1, temperature=0
    )
    assert first.usage.prompt_tokens > 1000  # its Prefill's ~4 kB take > 15 s at 1 kbit/s
    holder = next(
        w
        for w in stack.prefill
        if any(
            e.get("msg") == "prefilled" and e["request_id"].startswith(first.id)
            for e in log_events(w)
        )
    )
    since = log_size(stack.router)
    prompt = words + " Which shelf is item5 on?"
    stack.bed.shape(holder.host, Link(rate_bit=1000))
    try:
        start = time.monotonic()
        r = client_of(stack).completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, timeout=60
        )
        took = time.monotonic() - start
    finally:
        stack.bed.shape(holder.host, LINK)
    ids = embedded.tokenizer.encode(prompt)
    assert [c.text for c in r.choices] == reference(
        engine, ids, SamplingParams(max_tokens=8, temperature=0)
    )
    failed = router_lines(stack, since, "worker call failed")
    assert [(e["address"], e["why"].split(":")[0]) for e in failed] == [
        (holder.address, "DEADLINE_EXCEEDED")
    ]
    assert PREFILL_TIMEOUT <= took < PREFILL_TIMEOUT + 15
    wait_whole(stack)


def test_every_decode_host_cut_waits_for_one_then_503(bed_stack, engine, embedded):
    """Both decode hosts cut off: a request waits (counted in the gauge) and is answered
    once a link comes back; cut off again for longer than --retry-wait: 503 + Retry-After."""
    stack = bed_stack
    assert stack.router is not None
    url = stack.router.url
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    gauge = ("pdserve_requests_waiting_for_worker", ())
    decode_hosts = [w.host for w in stack.decode]
    try:
        for host in decode_hosts:
            stack.bed.cut(host)
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, timeout=30)
        answers: list[httpx.Response] = []
        asked = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            )
        )
        asked.start()
        wait_until(lambda: metrics(url).get(gauge) == 1, timeout=10)
        stack.bed.restore(decode_hosts[0])
        asked.join()
        ids = embedded.tokenizer.encode(PROMPT)
        expected = reference(engine, ids, SamplingParams(max_tokens=8, temperature=0))
        assert answers[0].status_code == 200
        assert [c["text"] for c in answers[0].json()["choices"]] == expected
        stack.bed.cut(decode_hosts[0])
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, timeout=30)
        start = time.monotonic()
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert RETRY_WAIT <= time.monotonic() - start < RETRY_WAIT + 5
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "service_unavailable" and "decode" in error["message"]
        assert metrics(url)[gauge] == 0
    finally:
        for host in decode_hosts:
            stack.bed.restore(host)
    wait_whole(stack)
