"""The encode stage of a prompt with images: the images go to an encode worker, which leaves
their rows in the store; the worker that then computes the prompt reads them there instead of
encoding (services/worker/images.py). An encoder that fails or times out is replaced by
another; with none left (or none configured) the computing worker encodes the images itself,
into the same rows, so the answer never depends on which way they came."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from router.errors import bad_request
from router.workers.registry import Registry, Tried
from services.rpc import worker_pb2 as pb
from services.tracing import CLIENT, Span

log = logging.getLogger("pdserve.router")
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS)


async def encode(
    registry: Registry,
    rid: str,
    images: Sequence[pb.Image],
    timeout: float,
    span: Span,
) -> bool:
    """Whether an encode worker put the images' rows in the store (False: none could, and
    the prompt's worker encodes them). 400 for an image an encoder refused."""
    request = pb.EncodeRequest(request_id=rid, images=images)
    tried = Tried()
    while True:
        candidates = [w for w in registry.available("encode") if tried.allows(w)]
        if not candidates:
            return False
        worker = min(candidates, key=lambda w: w.busy)
        worker.inflight += 1
        call = span.child("Encode", CLIENT, worker=worker.address, request_id=rid)
        metadata = (("traceparent", call.traceparent),) if call.recording else None
        try:
            await worker.stub.Encode(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() in REFUSED:
                raise bad_request(e.details() or "refused by the encoder", "messages") from e
            registry.failed(worker, f"{e.code().name}: {e.details()}")
            tried.add(worker)
            continue
        finally:
            worker.inflight -= 1
            call.end()
        registry.succeeded(worker)
        return True
