"""The encode stage of a prompt with images: the images go to encode workers, which leave
their rows in the store; the worker that then computes the prompt reads them there instead of
encoding (services/worker/images.py). Each image goes to the encoder its bytes pick among
those available (rendezvous hashing): a repeated image reaches the encoder that has it, or is
encoding it, so no two encoders make the same rows, and one request's images spread over the
encoders. An encoder that fails or times out is replaced by the next one its images pick;
with none left (or none configured) the computing worker encodes those images itself, into
the same rows, so the answer never depends on which way they came.

The prompt does not wait for its images: the router calls the prefill worker while the
encoders work (`beside`), and the worker queues the prompt until the rows are in the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from router.errors import bad_request
from router.workers.registry import Registry, Tried, WorkerState
from services.rpc import worker_pb2 as pb
from services.tracing import CLIENT, Span

log = logging.getLogger("pdserve.router")
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS)
T = TypeVar("T")
Prefill = Callable[[str, list[pb.Image] | None], Awaitable[T]]  # (request id, images)


async def beside(
    encode: asyncio.Future[bool] | None, prefill: Prefill[T], rid: str, waiting: list[pb.Image]
) -> T:
    """The prompt's prefill while `encode` (encode's task) makes its images' rows: the worker
    gets the images `waiting` (Image.wait_ms) and waits for the rows in the store. Where the
    encoders fail to store them all, the prompt goes again, under a request id of its own
    (the first may not have left the worker yet), as files alone: its worker encodes them."""
    if encode is None:
        return await prefill(rid, None)
    first = asyncio.ensure_future(prefill(rid, waiting))
    both: set[asyncio.Future[Any]] = {encode, first}
    try:
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        if first.done() or encode.result():  # (an image an encoder refused: its 400)
            return await first
        log.info(
            "rows not stored; the prefill worker encodes", extra={"fields": {"request_id": rid}}
        )
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        return await prefill(rid + "-encoding-failed", None)
    finally:
        for task in both:
            task.cancel()
        await asyncio.gather(*both, return_exceptions=True)


def pick(image: bytes, encoders: Sequence[WorkerState]) -> WorkerState:
    """The encoder an image goes to: the highest of hash(image, address) (rendezvous)."""
    digest = hashlib.sha256(image).digest()
    return max(encoders, key=lambda w: hashlib.sha256(digest + w.address.encode()).digest())


async def encode(
    registry: Registry, rid: str, images: Sequence[pb.Image], timeout: float, span: Span
) -> bool:
    """Whether encode workers put every image's rows in the store (False: some were left
    to the prompt's worker). 400 for an image an encoder refused."""
    tried = Tried()
    left = list(images)
    while left:
        encoders = [w for w in registry.available("encode") if tried.allows(w)]
        if not encoders:
            return False
        groups: dict[str, tuple[WorkerState, list[pb.Image]]] = {}
        for image in left:
            worker = pick(image.data, encoders)
            groups.setdefault(worker.address, (worker, []))[1].append(image)
        calls = [_call(registry, rid, w, group, timeout, span) for w, group in groups.values()]
        done = await asyncio.gather(*calls)
        left = []
        for (worker, group), ok in zip(groups.values(), done, strict=True):
            if not ok:
                tried.add(worker)
                left += group
    return True


async def _call(
    registry: Registry,
    rid: str,
    worker: WorkerState,
    images: list[pb.Image],
    timeout: float,
    span: Span,
) -> bool:
    """One Encode; False when the encoder failed (its images go elsewhere)."""
    worker.inflight += 1
    call = span.child("Encode", CLIENT, worker=worker.address, request_id=rid)
    metadata = (("traceparent", call.traceparent),) if call.recording else None
    try:
        request = pb.EncodeRequest(request_id=rid, images=images)
        await worker.stub.Encode(request, timeout=timeout, metadata=metadata)
    except grpc.aio.AioRpcError as e:
        if e.code() in REFUSED:
            raise bad_request(e.details() or "refused by the encoder", "messages") from e
        registry.failed(worker, f"{e.code().name}: {e.details()}")
        return False
    finally:
        worker.inflight -= 1
        call.end()
    registry.succeeded(worker)
    return True
