"""`pdserve health`: is the pdserve service on this port ready? For Docker HEALTHCHECK and
Kubernetes exec probes, where one image serves every role.

The router answers HTTP (`/health`: 200 once it has a prefill and a decode worker); workers
answer gRPC (`Health`: ready while serving). Both are tried; `live` accepts any answer.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx

from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg


def probe(port: int, live: bool = False, address: str = "127.0.0.1", timeout: float = 3.0) -> bool:
    try:
        status = httpx.get(f"http://{address}:{port}/health", timeout=timeout).status_code
        return live or status == 200
    except httpx.HTTPError:
        pass  # not HTTP/1.1: a worker's gRPC port, or nothing
    return asyncio.run(_grpc_probe(f"{address}:{port}", live, timeout))


async def _grpc_probe(address: str, live: bool, timeout: float) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        stubs = (pbg.PrefillWorkerStub, pbg.DecodeWorkerStub, pbg.EncodeWorkerStub)
        for stub in (make(channel) for make in stubs):
            try:
                reply = await stub.Health(pb.HealthRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue  # another role's service
                return False
            return live or bool(reply.ready)
    return False
