"""AsyncEngine: an Engine on a thread of its own, driven from asyncio (the workers' servers).

The engine thread owns the engine: requests and aborts reach it as commands, and it steps
whenever there is work, so a slow coroutine never stalls the batch and a long forward pass
never stalls the event loop (torch releases the GIL while it computes). Each request's deltas
arrive, in order, on an asyncio queue; the last one carries the finish reason.

What callers do to their futures never reaches the engine thread: a command whose caller
gave up before it ran is skipped, a request whose submitter or reader was cancelled is
aborted. If the thread dies anyway (a bug), every caller and stream gets `EngineDied` at
once and `failure` says why: the worker reports unhealthy and exits (services/worker/).
`heartbeat` is when the thread last came round its loop, for the worker's watchdog.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from services.engine.engine import Engine
from services.engine.kv_connector import KVConnector
from services.engine.outputs import SequenceDelta
from services.engine.request import EngineRequest, Status
from services.model.errors import RankLost

log = logging.getLogger("pdserve.engine")
T = TypeVar("T")
ROUND_WAIT = 0.002  # seconds an idle rank waits between votes (data-parallel ranks)
Stream = asyncio.Queue[SequenceDelta | BaseException]


class EngineDied(RuntimeError):
    """The engine thread is gone: nothing queued or submitted will run."""


class _Killed(BaseException):
    """Raised on the engine thread by `kill` (a test hook): nothing catches it."""


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load, refreshed after every step."""

    waiting: int = 0
    running: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    total_blocks: int = 0
    referenced_blocks: int = 0
    tokens_in_flight: int = 0
    prefix_hit_tokens: int = 0  # since start, found in the prefix cache
    approximate_tokens: int = 0  # since start, placed from the chunk cache (chunk_reuse.py)
    cached_chunks: int = 0


@dataclass(frozen=True)
class _Command:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future[Any]

    def run(self, engine: Engine) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # the caller gave up before it ran: do nothing on its behalf
        try:
            result = self.fn(engine)
        except BaseException as e:
            self.future.set_exception(e)
        else:
            self.future.set_result(result)


class Rounds(Protocol):
    """Other engines this one steps with (services/model/parallel/data.py's Lockstep): each
    round of the loop is one vote, cast by the step's pass or by `idle`."""

    def idle(self) -> bool:
        """A round with no step: whether another engine's pass ran one here (an empty pass)."""
        ...

    def round_done(self) -> None:
        """After a step (which may have run no pass)."""
        ...


class AsyncEngine:
    def __init__(self, engine: Engine, rounds: Rounds | None = None) -> None:
        """`rounds`: the data-parallel ranks this engine keeps in step with (None: alone)."""
        self.engine = engine
        self.rounds = rounds
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()  # None: kill
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()  # orders a command's queueing against the thread's death
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the engine thread stopped (None: it serves)
        self.heartbeat = time.monotonic()
        self.load = EngineLoad()
        # the hashes of the blocks the prefix cache holds, as of the last step: what the event
        # loop reads instead of the block manager the engine thread changes
        self.cached_hashes: frozenset[bytes] = frozenset()
        self._cache_version = -1

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self.failure is None:
            await asyncio.to_thread(self._thread.join)

    @property
    def alive(self) -> bool:
        return self.failure is None and self._thread is not None and self._thread.is_alive()

    def stalled_for(self) -> float:
        """Seconds since the thread last came round its loop while it had work (else 0)."""
        if not (self.load.running or self.load.waiting):
            return 0.0
        return time.monotonic() - self.heartbeat

    # -- called from coroutines --------------------------------------------------------

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread, between steps; its result or exception.
        Cancelling the caller before the command runs means it never runs."""
        return await asyncio.wrap_future(self._post(fn))

    def _post(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self.failure is not None:
                raise EngineDied(self.failure)
            self._commands.put(_Command(fn, future))
        self._wake.set()
        return future

    async def submit(
        self, request: EngineRequest, connector: KVConnector | None = None
    ) -> AsyncIterator[SequenceDelta]:
        """Add a request (Engine.add_request, with its KV connector); raises its
        ValidationError before anything is queued. Iterate the result for the request's
        deltas; a reader that stops before the last one aborts the request."""
        stream: Stream = asyncio.Queue()
        request_id = request.request_id

        def add(engine: Engine) -> None:
            engine.add_request(request, connector)
            self._streams[request_id] = stream  # on the engine thread: before its first step

        try:
            await self.call(add)
        except asyncio.CancelledError:  # the add may have run: undo it if it did
            self.abort_soon(request_id, stream)
            raise
        return self._drain(request_id, stream)

    async def _drain(self, request_id: str, stream: Stream) -> AsyncIterator[SequenceDelta]:
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_soon(request_id, stream)

    async def abort(self, request_id: str) -> bool:
        """Abort a request if it is still in the engine; True if it was."""
        return await self.call(lambda engine: self._abort(engine, request_id))

    def abort_soon(self, request_id: str, stream: Stream | None = None) -> None:
        """Abort without waiting (safe in a cancelled task's cleanup); with `stream`, only
        if the request is still the one that stream belongs to."""
        with contextlib.suppress(EngineDied):  # dead: nothing left to abort
            self._post(lambda engine: self._abort(engine, request_id, stream))

    def _abort(self, engine: Engine, request_id: str, stream: Stream | None = None) -> bool:
        if stream is not None and self._streams.get(request_id) is not stream:
            return False
        found = request_id in engine.requests
        self._publish(engine.abort(request_id))
        self._streams.pop(request_id, None)
        return found

    async def abort_all(self) -> None:
        """Abort every request the engine holds (a worker's shutdown), on the engine thread."""

        def abort_all(engine: Engine) -> None:
            for request_id in list(engine.requests):
                self._abort(engine, request_id)

        await self.call(abort_all)

    def kill(self) -> None:
        """Test hook: the engine thread dies at its next command, as it would of a bug."""
        self._commands.put(None)
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            log.critical("engine thread died", exc_info=True)
            self._die(f"engine thread died: {type(e).__name__}: {e}")

    def _serve(self) -> None:
        while not self._stopping:
            self.heartbeat = time.monotonic()
            self._run_commands()
            if self.engine.has_unfinished and not self.engine.only_awaiting_rows:
                try:
                    self._publish(self.engine.step())
                except RankLost:  # no pass can finish now: the engine thread dies
                    raise
                except Exception:  # a bug: log it, fail the requests, keep serving
                    log.exception("engine step failed; aborting its requests")
                    for request_id in list(self.engine.requests):
                        self._publish(self.engine.abort(request_id))
                if self.rounds is not None:
                    self.rounds.round_done()
                self._refresh_load()
            else:
                self._refresh_load()
                if self.rounds is not None and self.rounds.idle():
                    continue  # another rank's pass ran here: theirs may go on at once
                # in step with other ranks, a short wait: each of their passes waits for ours
                self._wake.wait(0.05 if self.rounds is None else ROUND_WAIT)
                self._wake.clear()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is None:
                raise _Killed("killed by the test hook")
            command.run(self.engine)

    def _die(self, why: str) -> None:
        """Fail every queued command and every stream: nothing will answer them now."""
        with self._lock:
            self.failure = why
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineDied(why))
        assert self._loop is not None
        for stream in self._streams.values():
            self._loop.call_soon_threadsafe(stream.put_nowait, EngineDied(why))
        self._streams.clear()

    def _publish(self, deltas: list[SequenceDelta]) -> None:
        """Hand a step's deltas to their streams: one wake-up of the event loop per step, not
        one per sequence (at batch 32, 31 fewer self-pipe writes and loop turns a step)."""
        assert self._loop is not None
        ready = []
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished and delta.request_id not in self.engine.requests:
                del self._streams[delta.request_id]
            ready.append((stream, delta))
        if ready:
            self._loop.call_soon_threadsafe(deliver, ready)

    def _refresh_load(self) -> None:
        e = self.engine
        if e.blocks.cache_version != self._cache_version:  # copied only when it changed
            self._cache_version = e.blocks.cache_version
            self.cached_hashes = frozenset(e.blocks.cached)
        seqs = [s for r in e.requests.values() for s in r.seqs]
        running = [s for s in seqs if s.status is Status.RUNNING]
        self.load = EngineLoad(
            waiting=len(e.scheduler.waiting),
            running=len(running),
            free_blocks=e.blocks.num_free,
            cached_blocks=e.blocks.num_cached,
            total_blocks=e.blocks.num_blocks,
            referenced_blocks=e.blocks.referenced_blocks(),
            tokens_in_flight=sum(s.num_tokens for s in running),
            prefix_hit_tokens=e.blocks.hits * e.blocks.block_size,
            approximate_tokens=e.reuse.reused,
            cached_chunks=len(e.reuse.cache.entries),
        )


def deliver(ready: list[tuple[Stream, SequenceDelta]]) -> None:
    for stream, delta in ready:
        stream.put_nowait(delta)
