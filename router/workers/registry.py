"""The router's view of its workers: who exists, who answers, how loaded, what each caches.

Workers come from the configuration and from the admin API. An address `dns:HOST:PORT`
stands for every address HOST resolves to, resolved again before each round of health
checks (a Kubernetes headless Service: pods that come and go are added and removed).

A background task asks each worker for Health and Load every `health_interval`, each call
allowed `health_timeout` seconds (a busy worker on two cores can answer late); a worker not
healthy is asked every RECHECK_UNHEALTHY seconds in between, so that one starting or
restarting is used as soon as it answers. A worker that answers "not ready", or whose
address refuses the connection (UNAVAILABLE: the process is gone), is left out at once; one
that does not answer in time, after `health_failures` checks in a row; one good answer brings
it back. A worker whose calls fail while serving requests `breaker_failures` times
in a row is left out for `breaker_cooldown` seconds (the circuit is open), then tried again.
Each return to health starts a new `epoch`: a request that gave up on a worker may try it
again once it has come back (restarted, say).

What a worker caches is inferred, not asked: the router remembers, per worker, the block
hashes of the prompts (and answers) it sent there, in a bounded LRU set.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvstore.block_hash import BLOCK_SIZE
from router.workers.backlog import Backlog
from services.rpc import keepalive
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.settings import RouterSettings

log = logging.getLogger("pdserve.router")
REMEMBERED_BLOCKS = 50_000  # per worker
REMEMBERED_CHUNKS = 5_000  # per worker: chunks of approximate reuse (Job.reuse_chunks)
# gRPC's reconnect backoff grows to 120 s by default: a worker restarted after a crash would
# stay unreachable long after it serves again. Retry the connection at least twice a second
# (a refused connection costs nothing). A link cut mid-stream: services/rpc/keepalive.py.
CHANNEL_OPTIONS = [
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.initial_reconnect_backoff_ms", 100),
    *keepalive.CLIENT_OPTIONS,
]
STUBS = {"prefill": pbg.PrefillWorkerStub, "decode": pbg.DecodeWorkerStub,
         "encode": pbg.EncodeWorkerStub}  # fmt: skip
# A worker not healthy (starting, restarting, refused) is asked this often, whatever the
# interval: a stack is ready, and a restarted worker back, as soon as it answers.
RECHECK_UNHEALTHY = 0.25


@dataclass
class WorkerState:
    role: str  # "prefill", "decode" or "encode"
    address: str
    channel: grpc.aio.Channel
    stub: Any  # PrefillWorkerStub, DecodeWorkerStub or EncodeWorkerStub
    healthy: bool = False
    namespace: str = ""
    refused: str | None = None  # why its KV cannot be used with the others' (Registry._check)
    load: pb.LoadReply = field(default_factory=pb.LoadReply)
    inflight: int = 0  # requests the router has on it now
    failures: int = 0  # consecutive failed calls while serving
    check_failures: int = 0  # consecutive health checks without an answer
    epoch: int = 0  # times it became healthy
    open_until: float = 0.0  # circuit breaker: left out until then
    cached: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    # chunks it was sent for approximate reuse (their digest -> tokens): it may keep them
    chunks: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    backlog: Backlog = field(default_factory=Backlog)  # prompt tokens sent, not yet answered
    clock: Callable[[], float] = time.monotonic  # what `open_until` is read on (tests: a fake)

    @property
    def available(self) -> bool:
        return self.healthy and self.clock() >= self.open_until

    @property
    def busy(self) -> int:
        """Requests on it, as best the router knows: its own count, or the worker's."""
        return max(self.inflight, self.load.running + self.load.waiting)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.cached:
            n += 1
        return n

    def remember(self, hashes: Sequence[bytes], chunks: Sequence[tuple[bytes, int]] = ()) -> None:
        """It served a prompt with these block hashes (and these chunks, reused
        approximately): it caches them, as far as the router knows."""
        for h in hashes:
            self.cached[h] = None
            self.cached.move_to_end(h)
        while len(self.cached) > REMEMBERED_BLOCKS:
            self.cached.popitem(last=False)
        for digest, tokens in chunks:
            self.chunks[digest] = tokens
            self.chunks.move_to_end(digest)
        while len(self.chunks) > REMEMBERED_CHUNKS:
            self.chunks.popitem(last=False)

    def cached_chunk_tokens(self, chunks: Sequence[tuple[bytes, int]]) -> int:
        """Tokens of `chunks` it may reuse approximately (an approximate hit, not a prefix)."""
        return sum(tokens for digest, tokens in chunks if digest in self.chunks)


class Registry:
    def __init__(
        self,
        settings: RouterSettings,
        on_health: Callable[[WorkerState, bool], None] = lambda worker, healthy: None,
        breaker_failures: int = 3,
        breaker_cooldown: float = 5.0,
    ) -> None:
        """`settings`: health_interval, health_timeout and health_failures; the circuit
        breaker's failures and cooldown are fixed here."""
        self.settings = settings
        self.breaker_failures = breaker_failures
        self.breaker_cooldown = breaker_cooldown
        self.on_health = on_health  # called on every change of a worker's health
        self.workers: dict[tuple[str, str], WorkerState] = {}
        self.discovered: dict[tuple[str, str], set[str]] = {}  # (role, dns name) -> addresses
        self.unresolved: set[str] = set()  # names whose last lookup failed
        self._task: asyncio.Task[None] | None = None

    def configure(self, role: str, address: str) -> None:
        """A worker from the settings: an address, or `dns:HOST:PORT` for all HOST's."""
        if address.startswith("dns:"):
            self.discovered.setdefault((role, address.removeprefix("dns:")), set())
        else:
            self.add(role, address)

    async def resolve(self) -> None:
        """Bring the workers behind each DNS name up to date with what it resolves to now."""
        loop = asyncio.get_running_loop()
        for (role, name), known in self.discovered.items():
            host, _, port = name.rpartition(":")
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except (OSError, ValueError) as e:
                if name not in self.unresolved:  # once until it resolves (none may exist yet)
                    log.warning(
                        "cannot resolve workers", extra={"fields": {"name": name, "why": str(e)}}
                    )
                self.unresolved.add(name)
                continue
            self.unresolved.discard(name)
            ips = {str(info[4][0]) for info in infos}
            found = {f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips}
            for address in sorted(found - known):
                self.add(role, address)
            for address in sorted(known - found):
                await self.remove(role, address)
            self.discovered[(role, name)] = found

    def add(self, role: str, address: str) -> WorkerState:
        key = (role, address)
        if key not in self.workers:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            stub_class = STUBS[role]
            self.workers[key] = WorkerState(role, address, channel, stub_class(channel))
            log.warning("worker added", extra={"fields": {"role": role, "address": address}})
        return self.workers[key]

    async def remove(self, role: str, address: str) -> bool:
        state = self.workers.pop((role, address), None)
        if state is None:
            return False
        await state.channel.close()
        log.warning("worker removed", extra={"fields": {"role": role, "address": address}})
        return True

    def of(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role]

    def available(self, role: str) -> list[WorkerState]:
        return [w for w in self.of(role) if w.available]

    @property
    def namespace(self) -> str:
        """The KV namespace the healthy workers agree on ('' before any answers)."""
        return next((w.namespace for w in self.workers.values() if w.healthy), "")

    def succeeded(self, worker: WorkerState) -> None:
        worker.failures = 0

    def failed(self, worker: WorkerState, why: str) -> None:
        worker.failures += 1
        if worker.failures >= self.breaker_failures:
            worker.open_until = worker.clock() + self.breaker_cooldown
            self._set_health(worker, False, f"circuit open: {why}")
        log.warning(
            "worker call failed",
            extra={
                "fields": {
                    "role": worker.role,
                    "address": worker.address,
                    "failures": worker.failures,
                    "why": why[:200],
                }
            },
        )

    # -- health checks -------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._check_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for state in list(self.workers.values()):
            await state.channel.close()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    async def _check_forever(self) -> None:
        due = 0.0  # when every worker is next asked
        while True:
            if time.monotonic() >= due:
                due = time.monotonic() + self.settings.health_interval
                await self.resolve()
                await self.check_all()
            else:
                unhealthy = [w for w in self.workers.values() if not w.healthy]
                await asyncio.gather(*(self._check(w) for w in unhealthy))
            await asyncio.sleep(min(RECHECK_UNHEALTHY, max(0.0, due - time.monotonic())))

    async def _check(self, worker: WorkerState) -> None:
        try:
            health = await worker.stub.Health(
                pb.HealthRequest(), timeout=self.settings.health_timeout
            )
            worker.load = await worker.stub.Load(
                pb.LoadRequest(), timeout=self.settings.health_timeout
            )
        except grpc.aio.AioRpcError as e:
            worker.check_failures += 1
            refused = e.code() == grpc.StatusCode.UNAVAILABLE  # nothing listens: gone, not late
            if refused or worker.check_failures >= self.settings.health_failures:
                self._set_health(worker, False, f"{e.code().name} x{worker.check_failures}")
            return
        worker.check_failures = 0
        refused = self._disagreement(worker, health)
        if refused != worker.refused:
            worker.refused = refused
            if refused:
                log.warning(
                    "worker refused",
                    extra={
                        "fields": {"role": worker.role, "address": worker.address, "why": refused}
                    },
                )
        if refused:
            self._set_health(worker, False, refused)
            return
        worker.namespace = health.namespace
        if not health.ready or health.role != worker.role:
            self._set_health(worker, False, "wrong role" if health.ready else "not ready")
        elif not worker.healthy:
            worker.failures = 0
            self._set_health(worker, True, "ready")

    def _disagreement(self, worker: WorkerState, health: pb.HealthReply) -> str | None:
        """Why a worker's KV cannot be used with the others' (None if it can): another block
        size than the router's, or another namespace than the healthy workers' (another
        model, dtype, quantization or codec: its blocks would never match theirs)."""
        if health.block_size != BLOCK_SIZE:
            return f"block size {health.block_size}, the router's {BLOCK_SIZE}"
        others = {w.namespace for w in self.workers.values() if w.healthy and w is not worker}
        if others and health.namespace not in others:
            return f"KV namespace {health.namespace}, the other workers' {min(others)}"
        return None

    def _set_health(self, worker: WorkerState, healthy: bool, why: str) -> None:
        if worker.healthy == healthy:
            return
        worker.healthy = healthy
        worker.epoch += healthy
        self.on_health(worker, healthy)
        log.warning(
            "worker healthy" if healthy else "worker unhealthy",
            extra={"fields": {"role": worker.role, "address": worker.address, "why": why}},
        )


class Tried:
    """The workers a request gave up on, each until it comes back (a new health epoch)."""

    def __init__(self) -> None:
        self.epochs: dict[str, int] = {}
        self.failures = 0

    def add(self, worker: WorkerState) -> None:
        self.epochs[worker.address] = worker.epoch
        self.failures += 1

    def allows(self, worker: WorkerState) -> bool:
        return self.epochs.get(worker.address, -1) != worker.epoch
