"""The prefill worker: computes prompts' KV, writes every prompt block to the KV store, and
answers with the first token.

One request: look up the longest prefix of the prompt already in the store and import it
(blocks the engine caches itself are shared, not fetched again); the engine computes the
rest in chunks, batched with other prompts; each block goes to the store as soon as it is
full and computed, while later chunks compute; the reply waits until every block it names
is written (DESIGN.md: when P replies, every block it names is readable).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from kvstore.store import StoreUnavailable
from prefill.transfer import PrefillTransfer
from services.engine.driver import EngineDied
from services.engine.params import ValidationError
from services.engine.request import EngineRequest, FinishReason
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc
from services.settings import Settings
from services.worker import convert
from services.worker.server import Worker, refuse, trace_steps, worker_config

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
        except ValidationError as e:
            await refuse(context, e)
        full, partial = self.link.hashes(prompt, request.salt)
        usable = max(0, (len(prompt) - 1) // self.layout.block_size)  # the last token computes
        if params.prompt_logprobs is not None:
            usable = 0  # a prompt being scored is computed whole
        kv = await self.link.fetch(rid, full[:usable], None, 0) if usable else None
        span.event("fetched", tokens=kv.num_tokens if kv is not None else 0)
        try:
            transfer = PrefillTransfer(kv, self.link.export, partial)
            stream = await self.driver.submit(
                EngineRequest(rid, prompt, params, request.salt, transfer=transfer,
                              block_hashes=full)
            )  # fmt: skip
            # a caller gone (cancelled) aborts the request as the stream is left
            delta = [d async for d in stream][-1]
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
            self.link.forget(rid)
            span.end()
        if delta.finish_reason is FinishReason.ABORT:
            await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
        cached = delta.num_cached_tokens
        log.info("prefilled", extra={"fields": {"request_id": rid, "cached": cached,
                                                 "computed": len(prompt) - cached}})  # fmt: skip
        reply = pb.PrefillReply(
            request_id=rid,
            first_token=delta.token_ids[0],
            block_hashes=[*full, *([partial] if partial else [])],
            cached_tokens=cached,
            store_tokens=delta.num_store_tokens,
            computed_tokens=len(prompt) - cached,
            text=delta.text,
            finish_reason=convert.FINISH[delta.finish_reason],
        )
        if delta.logprobs:
            reply.first_logprobs.CopyFrom(convert.logprobs_proto(delta.logprobs[0]))
        reply.prompt_logprobs.extend(convert.logprobs_proto(lp) for lp in delta.prompt_logprobs)
        return reply


def run(settings: Settings) -> int:
    """The `prefill` role's entry point (pyproject.toml)."""
    return asyncio.run(PrefillWorker(worker_config(settings, "prefill")).serve())
