"""What a call to a worker carries besides its message, and how a broken stream is told:
the trace context as gRPC metadata, a seed as the wire's int64."""

from __future__ import annotations

import grpc

from router.workers.registry import WorkerState
from services.tracing import Span


def trace_metadata(span: Span) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the span's context to the worker (none when not tracing)."""
    return (("traceparent", span.traceparent),) if span.recording else None


def int64(seed: int) -> int:
    """A seed as the wire's int64: the same 64 bits (the sampler reads them unsigned)."""
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


def raise_stream_ended(worker: WorkerState) -> None:
    raise grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"stream from {worker.address} ended before finishing",
    )
