"""Routing policies, the circuit breaker and DNS discovery, on the router's worker records
alone (no worker processes)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest

from router.workers.policy import Policy
from router.workers.registry import Registry, WorkerState
from services.rpc import worker_pb2 as pb
from services.settings import RouterSettings


def worker(
    role: str, address: str, busy: int = 0, clock: Callable[[], float] = time.monotonic
) -> WorkerState:
    state = WorkerState(role, address, channel=None, stub=None, healthy=True, clock=clock)  # type: ignore[arg-type]
    state.inflight = busy
    return state


def policy(name: str, imbalance: int = 8) -> Policy:
    return Policy(RouterSettings(policy=name, imbalance=imbalance))


class Clock:
    """Seconds that pass only when the test moves them on."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def until(condition: Callable[[], bool], deadline: float = 30.0) -> None:
    """Wait for `condition`; the deadline only bounds a hang."""
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        await asyncio.sleep(0.01)


def picks(policy: Policy, workers: list[WorkerState], hashes: list[bytes], n: int) -> list[str]:
    return [policy.pick(workers, hashes).address for _ in range(n)]


def test_round_robin_takes_turns_per_role():
    rr = policy("round_robin")
    p = [worker("prefill", "p1"), worker("prefill", "p2")]
    d = [worker("decode", "d1"), worker("decode", "d2")]
    order = [rr.pick(group, []).address for _ in range(3) for group in (p, d)]
    assert order == ["p1", "d1", "p2", "d2", "p1", "d1"]  # prefill and decode turn apart


def test_least_load_uses_the_larger_of_router_and_worker_counts():
    least = policy("least_load")
    a, b = worker("decode", "a", busy=1), worker("decode", "b")
    b.load = pb.LoadReply(running=3, waiting=1)  # the worker knows of more than the router sent
    assert picks(least, [a, b], [], 2) == ["a", "a"]
    a.inflight = 0
    assert sorted(picks(least, [a, worker("decode", "c")], [], 2)) == ["a", "c"]  # ties in turn


def test_kv_aware_prefers_the_cached_prefix_until_load_is_imbalanced():
    kv = policy("kv_aware", imbalance=2)
    hashes = [b"h0", b"h1", b"h2"]
    a, b, c = worker("prefill", "a"), worker("prefill", "b"), worker("prefill", "c")
    b.remember(hashes[:2])
    c.remember(hashes[:1])
    assert picks(kv, [a, b, c], hashes, 2) == ["b", "b"]  # the longest prefix
    b.inflight = 2
    assert kv.pick([a, b, c], hashes).address == "b"  # busier by 2: still within bound
    b.inflight = 3
    assert kv.pick([a, b, c], hashes).address == "c"  # busier by 3: the next best cache
    assert {kv.pick([a, c], [b"other"]).address for _ in range(2)} == {"a", "c"}  # misses


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round_robin"):
        policy("random")


def test_circuit_opens_after_consecutive_failures_and_closes_after_cooldown():
    registry = Registry(RouterSettings(), breaker_failures=3, breaker_cooldown=0.5)
    clock = Clock()
    w = registry.workers[("decode", "d")] = worker("decode", "d", clock=clock)
    registry.failed(w, "x")
    registry.succeeded(w)  # not consecutive: starts again
    registry.failed(w, "x")
    registry.failed(w, "x")
    assert registry.available("decode") == [w]
    registry.failed(w, "x")
    assert registry.available("decode") == []
    w.healthy = True  # a health check answered; the circuit still holds until the cooldown
    assert registry.available("decode") == []
    clock.now += 0.25
    assert registry.available("decode") == []
    clock.now += 0.25  # the cooldown is over
    assert registry.available("decode") == [w]


def test_dns_names_track_what_they_resolve_to(monkeypatch):
    """A headless Service's pods come and go: workers are added and removed to match (the DNS
    answers are the one thing faked: a test cannot change what a name resolves to)."""
    answers = {"workers.svc": ["10.0.0.1", "10.0.0.2"]}

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    async def run() -> list[list[str]]:
        registry = Registry(RouterSettings(), breaker_failures=3, breaker_cooldown=1)
        registry.configure("decode", "dns:workers.svc:50052")
        registry.configure("decode", "dns:gone.svc:50052")  # unresolvable: logged, skipped
        registry.configure("prefill", "10.0.0.9:50051")
        seen = []
        for change in (None, ["10.0.0.2", "10.0.0.3"], []):
            if change is not None:
                answers["workers.svc"] = change
            await registry.resolve()
            seen.append(sorted(w.address for w in registry.of("decode")))
        assert [w.address for w in registry.of("prefill")] == ["10.0.0.9:50051"]
        await registry.stop()
        return seen

    assert asyncio.run(run()) == [
        ["10.0.0.1:50052", "10.0.0.2:50052"],
        ["10.0.0.2:50052", "10.0.0.3:50052"],
        [],
    ]


def test_a_request_returns_to_a_worker_it_gave_up_on_once_that_worker_is_back():
    from router.errors import APIError
    from router.workers.generation import Pipeline, Tried

    registry = Registry(RouterSettings(), breaker_failures=3, breaker_cooldown=0.2)
    a = registry.workers[("prefill", "a")] = worker("prefill", "a")
    b = registry.workers[("prefill", "b")] = worker("prefill", "b")
    rr = policy("round_robin")
    hasty = Pipeline(registry, rr, RouterSettings(retry_wait=0.6))
    patient = Pipeline(registry, rr, RouterSettings(retry_wait=60))  # only bounds a hang

    async def run() -> None:
        tried = Tried()
        tried.add(a)
        assert await hasty._pick("prefill", [], tried) is b  # not the one that failed
        tried.add(b)
        start = time.monotonic()
        with pytest.raises(APIError) as none:  # both failed, neither came back: 503
            await hasty._pick("prefill", [], tried)
        assert none.value.status == 503 and time.monotonic() - start >= 0.6

        waiting = asyncio.create_task(patient._pick("prefill", [], tried))
        await asyncio.sleep(0.3)  # it looks and finds no worker (every 0.25 s)
        assert not waiting.done()
        a.epoch += 1  # unhealthy, restarted, healthy again
        assert await waiting is a  # waited for it

        for _ in range(6):  # a worker in a crash loop: the request gives up
            tried.add(a)
            a.epoch += 1
        with pytest.raises(APIError):
            await patient._pick("prefill", [], tried)

    asyncio.run(run())


class AnsweringStub:
    """A worker's Health and Load answers (a worker process cannot run another block size),
    and how often Health was asked."""

    def __init__(self, health: pb.HealthReply) -> None:
        self.health = health
        self.asked = 0

    async def Health(self, request: pb.HealthRequest, timeout: float) -> pb.HealthReply:
        self.asked += 1
        return self.health

    async def Load(self, request: pb.LoadRequest, timeout: float) -> pb.LoadReply:
        return pb.LoadReply()


def test_a_worker_with_another_block_size_or_namespace_is_refused_and_logged(caplog):
    registry = Registry(RouterSettings(), breaker_failures=3, breaker_cooldown=1)
    good = pb.HealthReply(role="decode", ready=True, namespace="ns-a", block_size=16)

    def add(address: str, health: pb.HealthReply) -> WorkerState:
        state = WorkerState("decode", address, channel=None, stub=AnsweringStub(health))  # type: ignore[arg-type]
        registry.workers[("decode", address)] = state
        return state

    first = add("a", good)
    asyncio.run(registry.check_all())
    assert first.healthy
    wide = add("b", pb.HealthReply(role="decode", ready=True, namespace="ns-a", block_size=32))
    other = add("c", pb.HealthReply(role="decode", ready=True, namespace="ns-b", block_size=16))
    with caplog.at_level("WARNING", logger="pdserve.router"):
        asyncio.run(registry.check_all())
        asyncio.run(registry.check_all())  # said once, not at every check
    assert first.healthy and not wide.healthy and not other.healthy
    refusals = [r.fields["why"] for r in caplog.records if r.getMessage() == "worker refused"]  # type: ignore[attr-defined]
    assert sorted(refusals) == [
        "KV namespace ns-b, the other workers' ns-a",
        "block size 32, the router's 16",
    ]
    other.stub = AnsweringStub(good)  # restarted with the others' layout
    asyncio.run(registry.check_all())
    assert other.healthy and other.refused is None


def test_a_worker_not_yet_ready_is_asked_often_and_used_as_soon_as_it_is():
    """With an hour's interval, a starting worker is asked again and again (every 0.25 s)
    and taken into use at the first answer after it is ready; a healthy one is not asked
    again before its interval."""
    registry = Registry(RouterSettings(health_interval=3600))
    ready = pb.HealthReply(role="decode", ready=True, namespace="ns", block_size=16)
    starting, steady = AnsweringStub(pb.HealthReply(role="decode")), AnsweringStub(ready)
    for address, stub in (("starting", starting), ("steady", steady)):
        state = WorkerState("decode", address, channel=None, stub=stub)  # type: ignore[arg-type]
        registry.workers[("decode", address)] = state

    async def run() -> int:
        registry.start()
        await until(lambda: starting.asked >= 3)  # asked again: not left for the interval
        starting.health = ready
        asked = starting.asked
        await until(lambda: registry.workers[("decode", "starting")].healthy)
        registry.workers.clear()  # stubs alone, no channels to close
        await registry.stop()
        return asked

    asked = asyncio.run(run())
    assert starting.asked == asked + 1  # the first answer after it was ready
    assert steady.asked == 1
