"""SIGTERM: the worker stops taking requests, lets the ones in flight finish within the grace
period, and exits."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from services.engine.params import SamplingParams
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params
from tests.support.workers import WorkerProcess


def test_sigterm_drains_then_exits(embedded_dir, tmp_path):
    args = ("--num-blocks", "64", "--grace-period", "20")
    worker = WorkerProcess("decode", str(embedded_dir), "memory://", tmp_path, *args).start()
    params = to_proto_params(SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = pbg.DecodeWorkerStub(channel)
            request = pb.DecodeRequest(
                request_id="inflight",
                prompt_token_ids=[1, 2, 3],
                params=params,
                seed=1,
                local_prefill=True,
            )
            call = stub.Decode(request)
            tokens: list[int] = []
            while True:
                chunk = await call.read()
                if chunk is grpc.aio.EOF:
                    break
                tokens += chunk.token_ids
                if len(tokens) == 1:  # streaming: now stop the worker
                    assert worker.process is not None
                    worker.process.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.5)
                    with pytest.raises(grpc.aio.AioRpcError):  # nothing new while draining
                        await stub.Health(pb.HealthRequest(), timeout=2)
                if chunk.finish_reason:
                    return tokens, chunk.finish_reason
        raise AssertionError("stream ended without a finish")

    tokens, finish = asyncio.run(run())
    assert len(tokens) == 40 and finish == pb.FINISH_REASON_LENGTH  # finished, not cut off
    # A supervisor may repeat its SIGTERM while the worker is on its way out: the worker still
    # exits cleanly, whenever in its teardown the signal lands.
    process = worker.process
    assert process is not None
    start = time.monotonic()
    while process.poll() is None and time.monotonic() - start < 10:
        process.send_signal(signal.SIGTERM)
        time.sleep(0.02)
    assert process.wait(timeout=1) == 0
    assert time.monotonic() - start < 10
