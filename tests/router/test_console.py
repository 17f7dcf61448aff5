"""The console's data (router/console/: page.py, recent.py): a request's phases from the
router's spans, to the millisecond; the store's rates from the workers' counters; the stack
view of the session's router over its real pool, with a chat's phases and the blocks it read
from the store; and who may see what: the page for everyone, the stack view with the admin
key where one is set, else an API key where those are set."""

from __future__ import annotations

import time

import httpx
import pytest

from router.console.recent import POINTS, Recent, StoreRates
from services.launcher import RouterProcess
from services.rpc import worker_pb2 as pb
from services.tracing import CLIENT, Tracer
from tests.support.cluster import load, wait_until

MS = 1_000_000  # ns


def traced(recent: Recent, prefill: bool) -> None:
    """One request's spans, ended as the router ends them, at made-up times (ms from 1000 s)."""
    tracer = Tracer("pdserve-router", None, recent)
    t0 = 1000 * 1000 * MS
    root = tracer.start(
        "POST /v1/chat/completions", None, request_id="chatcmpl-1", prompt_tokens=40
    )
    root.start_ns = t0
    if prefill:
        call = root.child("Prefill", CLIENT, worker="127.0.0.1:1")
        call.start_ns = t0 + 5 * MS
        call.end(t0 + 50 * MS)
    decode = root.child("Decode", CLIENT, worker="127.0.0.1:2")
    decode.start_ns = t0 + (51 if prefill else 3) * MS
    for at, tokens in ((80, 1), (90, 2), (100, 1)) if prefill else ((40, 1), (50, 1)):
        decode.event("chunk", t0 + at * MS, tokens=tokens)
    decode.end(t0 + (101 if prefill else 52) * MS)
    root.end(t0 + (102 if prefill else 53) * MS)


def test_a_disaggregated_requests_phases_come_from_its_spans():
    recent = Recent(clock=lambda: 1000.2)
    traced(recent, prefill=True)
    (record,) = recent.requests
    assert record["phases_ms"] == {"queue": 5.0, "prefill": 45.0, "transfer": 30.0, "decode": 21.0}
    assert (record["tokens"], record["prompt_tokens"], record["total_ms"]) == (5, 40, 102.0)
    assert (record["ttft_ms"], record["itl_ms"]) == (50.0, 12.75)  # (101 - 50) / 4
    assert (record["prefill_worker"], record["decode_worker"]) == ("127.0.0.1:1", "127.0.0.1:2")
    assert record["id"] == "chatcmpl-1" and record["path"] == "/v1/chat/completions"
    assert recent.latency() == [{"t": 1000.102, "ttft_ms": 50.0, "itl_ms": 12.75}]


def test_a_prompt_computed_on_the_decode_worker_is_its_prefill():
    recent = Recent()
    traced(recent, prefill=False)
    (record,) = recent.requests
    assert record["phases_ms"] == {"queue": 3.0, "prefill": 37.0, "transfer": 0.0, "decode": 12.0}
    assert (record["tokens"], record["ttft_ms"], record["itl_ms"]) == (2, 40.0, 12.0)
    assert record["prefill_worker"] is None


def test_latency_points_leave_the_window_and_requests_the_list():
    now = [1000.2]
    recent = Recent(keep=3, window_s=60, clock=lambda: now[0])
    for _ in range(5):
        traced(recent, prefill=True)
    assert len(recent.requests) == 3 and len(recent.latency()) == 5
    now[0] = 1060.1  # 60 s after they ended
    assert len(recent.latency()) == 5
    now[0] = 1060.11
    assert recent.latency() == [] and len(recent.requests) == 3
    busy = Recent(clock=lambda: 1000.2)  # many requests in the window: the newest POINTS
    for _ in range(POINTS + 5):
        traced(busy, prefill=True)
    assert len(busy.latency()) == POINTS


class _Worker:
    def __init__(self, address: str) -> None:
        self.address = address
        self.load = pb.LoadReply()

    def counts(self, hits: int, misses: int, read: int, written: int) -> None:
        self.load = pb.LoadReply(
            store_hits=hits, store_misses=misses, store_bytes_read=read, store_bytes_written=written
        )


def test_store_rates_are_over_the_last_seconds_and_survive_a_restart():
    rates = StoreRates()
    prefill, decode = _Worker("p"), _Worker("d")
    prefill.counts(0, 0, 0, 1000)
    decode.counts(4, 1, 400, 0)
    first = rates.sample(100.0, [prefill, decode])  # type: ignore[list-item]
    assert (first["hits"], first["misses"], first["bytes_in"], first["bytes_out"]) == (
        4,
        1,
        1000,
        400,
    )
    assert first["bytes_in_per_s"] == 0 and first["hits_per_s"] == 0  # one sample: no rate yet
    prefill.counts(0, 0, 0, 3000)
    decode.counts(8, 1, 800, 0)
    second = rates.sample(102.0, [prefill, decode])  # type: ignore[list-item]
    assert (second["bytes_in_per_s"], second["bytes_out_per_s"], second["hits_per_s"]) == (
        1000,
        200,
        2.0,
    )
    decode.counts(2, 0, 200, 0)  # restarted: counts from 0 again
    third = rates.sample(108.0, [prefill, decode])  # type: ignore[list-item]
    assert (third["hits"], third["bytes_out"]) == (10, 1000)
    # over the last 5 s or more: from the sample at 102 s
    assert (third["hits_per_s"], third["bytes_out_per_s"], third["bytes_in_per_s"]) == (
        round(2 / 6, 2),
        round(200 / 6),
        0,
    )


def stack(url: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/console/stack", headers=headers, timeout=10)


def test_the_stack_view_shows_the_pool_a_chat_and_the_blocks_it_read(pool, router, client):
    view = wait_until(
        lambda: (v := stack(router.url).json()) and all(w["healthy"] for w in v["workers"]) and v,
        30,
    )
    assert sorted(w["role"] for w in view["workers"]) == ["decode", "decode", "prefill", "prefill"]
    assert {w["blocks_total"] for w in view["workers"]} == {400}
    assert view["model"] == "SmolLM2-135M-Instruct" and view["colocated"] is False
    workers = [*pool[0], *pool[1]]
    before, counted = settled(router.url), counts(workers)
    words = "Tell me a story about a lighthouse keeper who finds a map in a bottle. " * 4
    messages = [{"role": "user", "content": words + str(time.time())}]  # a prompt not cached
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0, messages=messages
    )

    def listed() -> dict | None:
        found = [r for r in stack(router.url).json()["requests"] if r["id"] == answer.id]
        return found[0] if found else None

    record = wait_until(listed, 10)
    assert record["tokens"] == answer.usage.completion_tokens == 8
    assert record["prompt_tokens"] == answer.usage.prompt_tokens
    spent = record["phases_ms"]
    assert spent["prefill"] > 0 and spent["transfer"] > 0 and spent["decode"] > 0
    assert record["ttft_ms"] < record["total_ms"]
    assert record["prefill_worker"] and record["decode_worker"]
    # what the workers counted of the store, seen by the view at its next Load polls: the
    # prefill worker wrote the new prompt's blocks; the decode worker read those it did not
    # compute (how many is its choice: its cache, the link's and the prompt's rates)
    done = counts(workers)
    moved = {k: done[k] - counted[k] for k in done}
    assert moved["store_bytes_written"] > 0 and moved["store_writes"] > 0
    after = wait_until(
        lambda: (
            (s := stack(router.url).json()["store"])
            and s["bytes_in"] - before["bytes_in"] == moved["store_bytes_written"]
            and s["hits"] - before["hits"] == moved["store_hits"]
            and s
        ),
        10,
    )
    assert after["bytes_out"] - before["bytes_out"] == moved["store_bytes_read"]
    assert after["misses"] - before["misses"] == moved["store_misses"]
    assert after["bytes_in_per_s"] > 0


STORE = ("store_hits", "store_misses", "store_writes", "store_bytes_read", "store_bytes_written")


def counts(workers: list) -> dict[str, int]:
    """The store's counters, summed over the workers, asked of them directly."""
    replies = [load(w) for w in workers]
    return {k: sum(int(getattr(r, k)) for r in replies) for k in STORE}


def settled(url: str) -> dict:
    """The stack view's store totals once two Load polls (1 s apart) have left them alone."""
    totals = ("hits", "misses", "bytes_in", "bytes_out")

    def still() -> dict | None:
        first = stack(url).json()["store"]
        time.sleep(2.5)
        second = stack(url).json()["store"]
        return second if all(first[k] == second[k] for k in totals) else None

    return wait_until(still, 30)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Routers without workers: one with API keys and an admin key, one with API keys only."""
    logs = tmp_path_factory.mktemp("console-routers")
    both = RouterProcess(logs, [], [], "--api-keys", "user", "--admin-key", "admin")
    keys = RouterProcess(logs, [], [], "--api-keys", "user")
    yield both.start(healthy=False), keys.start(healthy=False)
    both.stop()
    keys.stop()


def test_the_page_is_open_and_the_stack_view_needs_the_admin_key(keyed):
    both, keys = keyed
    page = httpx.get(both.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/console/static/console.js">' in page.text
    script = httpx.get(both.url + "/console/static/console.js")
    assert script.status_code == 200 and "text/javascript" in script.headers["content-type"]
    missing = httpx.get(both.url + "/console/static/secrets.txt")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no console file 'secrets.txt'"
    for key in (None, "user", "wrong"):
        refused = stack(both.url, key)
        assert refused.status_code == 401
        assert refused.json()["error"]["message"] == "the stack view needs the admin key"
    assert stack(both.url, "admin").json()["workers"] == []
    # API keys only: any of them shows the view
    assert stack(keys.url, "user").status_code == 200
    assert stack(keys.url, "wrong").json()["error"]["message"] == "the stack view needs an API key"


def test_without_keys_the_stack_view_is_open(router):
    assert stack(router.url).status_code == 200
