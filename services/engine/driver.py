"""AsyncEngine: an Engine on a thread of its own, driven from asyncio (the workers' servers).

The engine thread owns the engine: requests and aborts reach it as commands, and it steps
whenever there is work, so a slow coroutine never stalls the batch and a long forward pass
never stalls the event loop (torch releases the GIL while it computes). Each request's deltas
arrive, in order, on an asyncio queue; the last one carries the finish reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from services.engine.engine import Engine
from services.engine.outputs import SequenceDelta
from services.engine.request import Status

log = logging.getLogger("pdserve.engine")
T = TypeVar("T")


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


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, asyncio.Queue[SequenceDelta]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.load = EngineLoad()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # -- called from coroutines --------------------------------------------------------

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread, between steps; its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn(self.engine))
            except BaseException as e:
                future.set_exception(e)

        self._commands.put(command)
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def submit(self, request_id: str, **kwargs: Any) -> AsyncIterator[SequenceDelta]:
        """Add a request (Engine.add_request's arguments); raises its ValidationError before
        anything is queued. Iterate the result for the request's deltas."""
        stream: asyncio.Queue[SequenceDelta] = asyncio.Queue()

        def add(engine: Engine) -> None:
            engine.add_request(request_id, **kwargs)
            self._streams[request_id] = stream  # on the engine thread: before its first step

        await self.call(add)
        return self._drain(request_id, stream)

    async def _drain(
        self, request_id: str, stream: asyncio.Queue[SequenceDelta]
    ) -> AsyncIterator[SequenceDelta]:
        while True:
            delta = await stream.get()
            yield delta
            if delta.finished:
                return

    async def abort(self, request_id: str) -> bool:
        """Abort a request if it is still in the engine; True if it was."""

        def abort(engine: Engine) -> bool:
            found = request_id in engine.requests
            self._publish(engine.abort(request_id))
            return found

        return await self.call(abort)

    # -- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._run_commands()
            if self.engine.has_unfinished:
                try:
                    self._publish(self.engine.step())
                except Exception:  # a bug: log it, fail the requests, keep serving
                    log.exception("engine step failed; aborting its requests")
                    for request_id in list(self.engine.requests):
                        self._publish(self.engine.abort(request_id))
                self._refresh_load()
            else:
                self._refresh_load()
                self._wake.wait(0.05)
                self._wake.clear()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _publish(self, deltas: list[SequenceDelta]) -> None:
        assert self._loop is not None
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished and delta.request_id not in self.engine.requests:
                del self._streams[delta.request_id]
            self._loop.call_soon_threadsafe(stream.put_nowait, delta)

    def _refresh_load(self) -> None:
        e = self.engine
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
        )
