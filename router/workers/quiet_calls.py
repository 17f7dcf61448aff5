"""Calls to workers nobody waits for: a Prefetch sent beside a Prefill, an Abort of a prefetch
no Decode will claim. A failure costs nothing (a prefetch not made is a fetch later; one not
aborted is dropped by its worker after a while), so none is raised or retried."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import grpc

from router.workers.registry import WorkerState
from services.rpc import worker_pb2 as pb

TIMEOUT = 5.0  # seconds each call may take


class QuietCalls:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[None]] = set()  # referenced until done

    def prefetch(self, worker: WorkerState, request: pb.PrefetchRequest) -> None:
        self._start(worker.stub.Prefetch(request, timeout=TIMEOUT))

    def abort(self, worker: WorkerState | None, request_id: str) -> None:
        if worker is not None:
            self._start(worker.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=TIMEOUT))

    def _start(self, call: Awaitable[object]) -> None:
        async def run() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call

        task = asyncio.create_task(run())
        self._running.add(task)
        task.add_done_callback(self._running.discard)
