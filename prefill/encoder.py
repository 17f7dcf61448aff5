"""The encode worker (`pdserve encode`): the first stage of computing a prompt with images.
It loads a model's vision tower and projector alone, runs each image of an Encode through
them unless the store holds its rows already, and puts the rows in the store
(kvstore/embeddings.py) before it replies; the prefill (or decode) worker that computes the
prompt then reads them there instead of encoding (services/worker/images.py). One image at a
time: an image's rows are the same bits whichever process makes them.

An encoder is a worker of the deployment like the others: it answers Health with the KV
namespace its peers compute (the router refuses one of another model or dtype) and Load with
its images in flight; SIGTERM lets the Encodes in flight finish within `grace_period`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

import grpc

from services.engine.params import ValidationError
from services.model.loader import load_encoder
from services.model.vision.images import ImageError
from services.rpc import keepalive, worker_pb2_grpc
from services.rpc import worker_pb2 as pb
from services.settings import Settings
from services.worker import convert
from services.worker.images import ImageSource
from services.worker.server import kv_layout, refuse

log = logging.getLogger("pdserve.encode")


class EncodeWorker(worker_pb2_grpc.EncodeWorkerServicer):
    role = "encode"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        ms = settings.model
        encoder, config, path = load_encoder(ms.model, ms.dtype, ms.device)
        dtype = encoder.dtype
        self.layout, _ = kv_layout(settings, path, config, dtype)
        self.namespace = self.layout.namespace()
        self.model_name = config.name
        self.images = ImageSource(encoder, self.namespace, dtype, settings.store)
        self.running = 0  # Encodes in flight
        self.ready = False

    async def Encode(self, request: pb.EncodeRequest, context: Any) -> pb.EncodeReply:
        rid = request.request_id
        self.running += 1
        try:
            convert.check_no_unknown_fields(request)
            if not rid:
                raise ValidationError("request_id", "must not be empty")
            encoded = stored = 0
            for image in request.images:
                made = await self.images.publish(image.data)
                encoded, stored = encoded + made, stored + (not made)
        except ImageError as e:
            await refuse(context, ValidationError("images", str(e)))
        except ValidationError as e:
            await refuse(context, e)
        finally:
            self.running -= 1
        log.info("encoded", extra={"fields": {"request_id": rid, "encoded": encoded}})
        return pb.EncodeReply(encoded=encoded, stored=stored)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthReply:
        return convert.health_reply(self)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadReply:
        counters = self.images.counters
        stats = self.images.store.stats()
        return pb.LoadReply(
            running=self.running,
            **convert.store_load(stats, counters.encoded, counters.store_hits),
        )

    async def serve(self) -> int:
        """Serve until SIGTERM or SIGINT; the Encodes in flight get `grace_period`."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *keepalive.SERVER_OPTIONS])
        worker_pb2_grpc.add_EncodeWorkerServicer_to_server(self, server)
        address = f"{self.settings.server.host}:{self.settings.port}"
        server.add_insecure_port(address)
        await server.start()
        self.ready = True
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.warning(
            "serving",
            extra={"fields": {"role": self.role, "address": address, "namespace": self.namespace}},
        )
        await stop.wait()
        self.ready = False
        await server.stop(self.settings.worker.grace_period)
        with contextlib.suppress(Exception):
            await self.images.close()
        return 0


def run(settings: Settings) -> int:
    """The `encode` role's entry point (pyproject.toml)."""
    return asyncio.run(EncodeWorker(settings).serve())
