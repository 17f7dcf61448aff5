"""TTFT under load (`--ttft-slo`): the router counts the prompt tokens queued on each worker
and learns how fast each computes them; a prompt that would wait past the SLO on every
prefill worker goes to a decode worker with room, and a request that could start in time
nowhere is refused with 429 and Retry-After, while those admitted finish with their tokens."""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx

from services.launcher import RouterProcess
from tests.support.cluster import MODEL, addresses, metrics

PROMPT_TOKENS = 1000  # 1.5-3.5 s alone on a float32 worker, by CPU


def slo_for(tmp_path, prefill, decode, *args: str) -> int:
    """A TTFT SLO (seconds) that one prompt alone meets and eight queued do not: 3x the time
    of one fresh prompt on these workers (at least 3 s), measured through a plain router."""
    router = RouterProcess(tmp_path, addresses(prefill), addresses(decode), *args).start()
    try:
        start = time.monotonic()
        assert complete(router.url, prompts(99, 1)[0]).status_code == 200
        alone = time.monotonic() - start
    finally:
        router.stop()
    return max(3, math.ceil(3 * alone))


def prompts(seed: int, count: int) -> list[list[int]]:
    """Token-id prompts no cache holds (random ids of ordinary tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def overload(url: str, first: list[list[int]], then: list[list[int]]):
    """Sends `first` at once and, when the first of them is answered (the workers' rates are
    known and most of the backlog is still queued), `then`; all responses, in order."""
    with ThreadPoolExecutor(len(first) + len(then)) as pool:
        wave = [pool.submit(complete, url, p) for p in first]
        wait(wave, return_when=FIRST_COMPLETED)
        late = [pool.submit(complete, url, p) for p in then]
        return [f.result() for f in wave], [f.result() for f in late]


def test_requests_past_the_slo_are_refused_and_the_admitted_finish(pool, tmp_path):
    # one worker, so that its rate is measured once the first prompt is answered
    _, decode = pool
    slo = slo_for(tmp_path, [], decode[:1], "--disagg-threshold", "100000")
    router = RouterProcess(
        tmp_path, [], addresses(decode[:1]), "--disagg-threshold", "100000", "--ttft-slo", str(slo)
    ).start()
    try:
        admitted, late = overload(router.url, prompts(1, 8), prompts(2, 3))
        assert [r.status_code for r in admitted] == [200] * 8
        assert all(r.json()["usage"]["completion_tokens"] == 2 for r in admitted)
        assert [r.status_code for r in late] == [429] * 3, [r.text for r in late]
        for r in late:
            assert int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
            assert f"limit {slo}s" in error["message"]
        values = metrics(router.url)
        assert values[("pdserve_requests_shed_total", ())] == 3
        # once the backlog has drained, the same request is served
        assert complete(router.url, prompts(2, 1)[0]).status_code == 200
    finally:
        router.stop()


def test_prompts_past_the_slo_on_prefill_spill_to_decode_with_the_same_tokens(pool, tmp_path):
    prefill, decode = pool
    slo = slo_for(tmp_path, prefill[:1], decode[:1])
    router = RouterProcess(
        tmp_path, addresses(prefill[:1]), addresses(decode[:1]), "--ttft-slo", str(slo)
    ).start()
    try:
        late_prompts = prompts(4, 2)
        admitted, late = overload(router.url, prompts(3, 8), late_prompts)
        assert [r.status_code for r in admitted + late] == [200] * 10
        values = metrics(router.url)
        spilled = ("pdserve_local_prefills_total", (("reason", "prefill_backlog"),))
        assert values[spilled] == 2  # the decode workers' rates were not measured: room
        assert values.get(("pdserve_requests_shed_total", ()), 0) == 0
        # the same prompts again, once the backlog is gone: the same tokens (through the prefill
        # worker where the router's learned rate says it is fast enough: on a slow CPU the
        # rate learned under the overload may still put them past the SLO, and they spill)
        again = [complete(router.url, p) for p in late_prompts]
        assert [r.json()["choices"][0]["text"] for r in again] == [
            r.json()["choices"][0]["text"] for r in late
        ]
    finally:
        router.stop()
