"""The prefill worker: computes prompts' KV, writes every prompt block to the KV store, and
answers with the first token.

One request: its connector (prefill/connector.py) looks up the longest prefix of the prompt
already in the store (blocks the engine caches itself are shared, not fetched again); the
engine computes the rest in chunks, batched with other prompts; each block goes to the store
as soon as it is full and computed, while later chunks compute; the reply waits until every
block is written (docs/design.md: when prefill replies, the prompt's blocks are readable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from kvstore.store import StoreUnavailable
from prefill.connector import PrefillConnector
from services.engine.driver import EngineDied
from services.engine.params import ValidationError
from services.engine.request import EngineRequest, FinishReason
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc
from services.settings import Settings
from services.worker import convert, siblings
from services.worker.chunk_link import reuse_fields
from services.worker.server import Worker, refuse, trace_steps

log = logging.getLogger("pdserve.prefill")


class PrefillWorker(Worker, worker_pb2_grpc.PrefillWorkerServicer):
    role = "prefill"

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillReply:
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        span = self.span("Prefill", context, request_id=rid, prompt_tokens=len(prompt))
        log.info("prefill", extra={"fields": {"request_id": rid, "prompt_tokens": len(prompt)}})
        try:
            convert.check_no_unknown_fields(request)
            params = convert.sampling_params(request.params, request.seed)
            if not rid:
                raise ValidationError("request_id", "must not be empty")
            spans, encoded, later = await self.prompt_images(prompt, request.images, later=True)
        except ValidationError as e:
            await refuse(context, e)
        connector = await PrefillConnector.fetch(
            self.link, rid, prompt, request.salt, params, spans
        )
        kv = connector.imported
        span.event("fetched", tokens=kv.num_tokens if kv is not None else 0)
        past = kv.num_tokens if kv is not None else 0
        reuse = await reuse_fields(self.chunks, rid, prompt, request, past)
        submitted = time.perf_counter()
        try:
            stream = await self.driver.submit(
                EngineRequest(
                    rid,
                    prompt,
                    params,
                    request.salt,
                    block_hashes=connector.block_hashes,
                    images=encoded,
                    **reuse,
                ),
                connector,
            )
            if later is not None:  # the prompt queued meanwhile
                await self.give_rows(rid, later)
                submitted, later = time.perf_counter(), None
            # a caller gone (cancelled) aborts the request as the stream is left
            delta = [d async for d in stream][-1]
            cached = delta.num_cached_tokens
            seconds = time.perf_counter() - submitted
            self.link.choice.prompts.observe(cached, len(prompt) - cached, seconds)
            trace_steps(span, delta, first=True)
            await self.link.wait_for_puts(rid)
            span.event("stored")
        except ValidationError as e:
            await refuse(context, e)
        except StoreUnavailable as e:  # the blocks may not all be readable: no reply
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv store: {e}")
        except EngineDied as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            if later is not None:
                later.close()  # (never started where the request went no further)
            self.link.forget(rid)
            span.end()
        if delta.finish_reason is FinishReason.ABORT:
            await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
        cached = delta.num_cached_tokens
        log.info(
            "prefilled",
            extra={
                "fields": {"request_id": rid, "cached": cached, "computed": len(prompt) - cached}
            },
        )
        reply = pb.PrefillReply(
            request_id=rid,
            first_token=delta.token_ids[0],
            cached_tokens=cached,
            store_tokens=delta.num_external_tokens,
            computed_tokens=len(prompt) - cached,
            approximate_tokens=delta.num_approximate_tokens,
            recomputed_tokens=delta.num_recomputed_tokens,
            text=delta.text,
            finish_reason=convert.FINISH[delta.finish_reason],
        )
        if delta.logprobs:
            reply.first_logprobs.CopyFrom(convert.logprobs_proto(delta.logprobs[0]))
        reply.prompt_logprobs.extend(convert.logprobs_proto(lp) for lp in delta.prompt_logprobs)
        return reply


def run(settings: Settings) -> int:
    """The `prefill` role's entry point (pyproject.toml)."""
    settings, ranks = siblings.start(settings, "prefill")  # --data-parallel's other ranks
    worker = PrefillWorker(settings)
    worker.siblings = ranks
    return asyncio.run(worker.serve())
