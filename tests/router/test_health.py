"""Health checks against a real gRPC worker stand-in whose answers the test controls: a late
answer within `health_timeout` is healthy, `health_failures` missed checks in a row are needed
before a worker is left out, "not ready" leaves it out at once, one good answer brings it
back in a new epoch, and every change is counted for /metrics."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import grpc

from kvstore.block_hash import BLOCK_SIZE
from router.metrics import Metrics
from router.workers.registry import Registry
from services.launcher import free_port
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.settings import RouterSettings

# A stand-in that answers is given all the time it needs, one that says nothing a short
# timeout: whether a check is missed never depends on how loaded the machine is.
ANSWERED = RouterSettings(health_interval=1.0, health_timeout=30.0)
SILENT = replace(ANSWERED, health_timeout=0.2)


class StandIn(pbg.PrefillWorkerServicer):
    """Answers Health and Load after `delay` seconds (None: never), saying `ready`."""

    def __init__(self) -> None:
        self.delay: float | None = 0.0
        self.ready = True

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthReply:
        if self.delay is None:
            await asyncio.Event().wait()  # until the caller gives up
        else:
            await asyncio.sleep(self.delay)
        return pb.HealthReply(
            role="prefill", model="m", ready=self.ready, namespace="ns", block_size=BLOCK_SIZE
        )

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadReply:
        return pb.LoadReply(running=2)


def test_health_tolerates_late_answers_and_needs_several_misses():
    async def run() -> None:
        stand_in = StandIn()
        server = grpc.aio.server()
        pbg.add_PrefillWorkerServicer_to_server(stand_in, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        metrics = Metrics()
        registry = Registry(ANSWERED, on_health=metrics.health_changed)
        worker = registry.add("prefill", f"127.0.0.1:{port}")

        async def check(delay: float | None) -> None:
            """One round of health checks, the stand-in answering after `delay` s or never."""
            stand_in.delay = delay
            registry.settings = SILENT if delay is None else ANSWERED
            await asyncio.wait_for(registry.check_all(), 60)  # 60 s: only bounds a hang

        try:
            await check(0.0)
            assert worker.healthy and worker.epoch == 1 and worker.load.running == 2

            await check(0.3)  # busy: late, but within the timeout
            assert worker.healthy and worker.check_failures == 0

            for misses in (1, 2):  # no answer: two misses are not yet enough
                await check(None)
                assert worker.healthy and worker.check_failures == misses
            await check(0.0)  # an answer in between starts the count again
            assert worker.check_failures == 0
            for _ in range(3):
                await check(None)
            assert not worker.healthy and registry.available("prefill") == []

            await check(0.0)  # one good answer: back, in a new epoch
            assert worker.healthy and worker.epoch == 2

            stand_in.ready = False  # draining or engine dead: out at once
            await check(0.0)
            assert not worker.healthy
            stand_in.ready = True
            await check(0.0)
            assert worker.healthy and worker.epoch == 3

            text = metrics.render(registry).decode()
            line = f'pdserve_worker_unhealthy_total{{role="prefill",worker="{worker.address}"}}'
            assert f"{line} 2.0" in text
        finally:
            await registry.stop()
            await server.stop(0)

    asyncio.run(run())


def test_a_worker_whose_address_refuses_is_left_out_at_once_and_back_when_it_answers():
    """A killed worker's port refuses connections: no missed checks are waited for (its
    restart may be back before three would be)."""

    async def serve(port: int) -> grpc.aio.Server:
        server = grpc.aio.server()
        pbg.add_PrefillWorkerServicer_to_server(StandIn(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server

    async def run() -> None:
        port = free_port()
        server = await serve(port)
        registry = Registry(ANSWERED, on_health=Metrics().health_changed)
        worker = registry.add("prefill", f"127.0.0.1:{port}")
        try:
            await registry.check_all()
            assert worker.healthy and worker.epoch == 1
            await server.stop(0)  # killed
            await registry.check_all()
            assert not worker.healthy and worker.check_failures == 1
            server = await serve(port)  # restarted on its port
            for _ in range(100):  # the channel reconnects after its backoff
                await registry.check_all()
                if worker.healthy:
                    break
                await asyncio.sleep(0.1)
            assert worker.healthy and worker.epoch == 2
        finally:
            await registry.stop()
            await server.stop(0)

    asyncio.run(run())
