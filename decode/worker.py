"""The decode worker: reads a request's prompt KV from the store, joins it to the running
batch and streams its tokens.

The fetch (decode/connector.py) runs in the request's own coroutine while the engine thread
keeps stepping the batch: a long prompt's KV arriving never stalls the other streams. Blocks
missing from the store, or refused by the codec, are computed here from the prompt tokens
(counted in Load's recomputed_tokens). With `local_prefill` (no prefill worker ran) the
same: what the store holds is read, the rest computed here. Finished generations' full
blocks are written back (setting), so the next turn of a conversation finds its prompt and
the answer in the store, whichever worker it reaches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from decode.connector import DecodeConnector
from decode.prefetch import Prefetcher
from services.engine.driver import EngineDied
from services.engine.params import SamplingParams, ValidationError
from services.engine.request import EngineRequest
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc
from services.settings import Settings
from services.tracing import Span
from services.worker import convert, siblings
from services.worker.chunk_link import reuse_fields
from services.worker.server import Worker, refuse, trace_steps

log = logging.getLogger("pdserve.decode")
HEAD = SamplingParams(max_tokens=1, temperature=0)  # a split's head: its KV is what counts


class DecodeWorker(Worker, worker_pb2_grpc.DecodeWorkerServicer):
    role = "decode"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.prefetcher = Prefetcher(self.link)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)

    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> pb.PrefetchReply:
        """Start reading the prompt's blocks as its prefill writes them (decode/prefetch.py)."""
        rid = request.request_id
        try:
            convert.check_no_unknown_fields(request)
            if not rid:
                raise ValidationError("request_id", "must not be empty")
        except ValidationError as e:
            await refuse(context, e)
        full, _ = self.link.hashes(list(request.prompt_token_ids), request.salt)
        return pb.PrefetchReply(started=self.prefetcher.start(rid, full))

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortReply:
        dropped = self.prefetcher.drop(request.request_id)
        reply = await super().Abort(request, context)
        return pb.AbortReply(found=reply.found or dropped)

    async def Decode(
        self, request: pb.DecodeRequest, context: Any
    ) -> AsyncIterator[pb.DecodeChunk]:
        rid = request.request_id
        prompt, output = list(request.prompt_token_ids), list(request.output_token_ids)
        span = self.span(
            "Decode",
            context,
            request_id=rid,
            prompt_tokens=len(prompt),
            local_prefill=request.local_prefill,
        )
        log.info(
            "decode",
            extra={
                "fields": {
                    "request_id": rid,
                    "prompt_tokens": len(prompt),
                    "local_prefill": request.local_prefill,
                }
            },
        )
        try:
            convert.check_no_unknown_fields(request)
            params = convert.sampling_params(request.params, request.seed)
            if not rid:
                raise ValidationError("request_id", "must not be empty")
            spans, encoded, _ = await self.prompt_images(prompt, request.images)
        except ValidationError as e:
            await refuse(context, e)

        async def compute_head(hashes: list[bytes], blocks: int) -> None:
            await self._compute_head(rid, prompt, request.salt, hashes, blocks)

        connector = await DecodeConnector.fetch(
            self.link,
            rid,
            prompt,
            request.salt,
            self.settings.worker.write_back,
            self.prefetcher,
            None if spans else compute_head,  # a head would need the images' rows too
            spans,
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
                    output_ids=output,
                    text_sent=request.text_sent if request.HasField("text_sent") else None,
                    block_hashes=connector.block_hashes,
                    images=encoded,
                    **reuse,
                ),
                connector,
            )
            measured = submitted if not output else None  # a migrated stream computes more
            async for chunk in self._chunks(rid, len(prompt), stream, span, measured):
                yield chunk
        except ValidationError as e:
            await refuse(context, e)
        except EngineDied as e:  # the router migrates the stream to another worker
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            span.end()

    async def _compute_head(
        self, rid: str, prompt: list[int], salt: bytes, hashes: list[bytes], blocks: int
    ) -> None:
        """The prompt's first `blocks` blocks computed by the engine (a request of their own,
        batched like any prompt), left in its prefix cache for the request to share: the
        head of a split between computing and reading (services/worker/fetch_choice.py). A
        failure costs nothing but the head: the request computes what the cache lacks."""
        tokens = blocks * self.layout.block_size
        request = EngineRequest(
            f"{rid}/head", prompt[:tokens], HEAD, salt, block_hashes=hashes[:blocks]
        )
        try:  # not a measure of the prompt rate: the reading shares the cores meanwhile
            async for _ in await self.driver.submit(request):
                pass
        except (ValidationError, EngineDied) as e:
            log.warning("head not computed", extra={"fields": {"request_id": rid, "why": str(e)}})

    async def _chunks(
        self,
        rid: str,
        prompt_len: int,
        stream: AsyncIterator[Any],
        span: Span,
        submitted: float | None,
    ) -> AsyncIterator[pb.DecodeChunk]:
        """`submitted`: when the request went to the engine, if its first token measures the
        prompt rate (fetch_choice.py)."""
        first, finished = True, False
        try:
            async for delta in stream:
                trace_steps(span, delta, first)
                if first:
                    cached = delta.num_cached_tokens
                    self.counters.recomputed_tokens += prompt_len - cached
                    if submitted is not None:
                        seconds = time.perf_counter() - submitted
                        self.link.choice.prompts.observe(cached, prompt_len - cached, seconds)
                    first = False
                chunk = pb.DecodeChunk(
                    token_ids=delta.token_ids,
                    text=delta.text,
                    logprobs=[convert.logprobs_proto(lp) for lp in delta.logprobs],
                    finish_reason=convert.FINISH[delta.finish_reason],
                    prompt_logprobs=[convert.logprobs_proto(lp) for lp in delta.prompt_logprobs],
                )
                if delta.finished:
                    finished = True
                    chunk.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=prompt_len,
                            completion_tokens=delta.num_output_tokens,
                            cached_tokens=delta.num_cached_tokens,
                            store_tokens=delta.num_external_tokens,
                            approximate_tokens=delta.num_approximate_tokens,
                            recomputed_tokens=delta.num_recomputed_tokens,
                        )
                    )
                    log.info(
                        "decoded",
                        extra={
                            "fields": {
                                "request_id": rid,
                                "tokens": delta.num_output_tokens,
                                "finish": delta.finish_reason.value
                                if delta.finish_reason
                                else None,
                            }
                        },
                    )
                span.event("send")  # handed to gRPC (after the yield may be later than received)
                yield chunk
        finally:
            if not finished:  # the client went away (or the server is stopping)
                log.info("cancelled", extra={"fields": {"request_id": rid}})
                self.driver.abort_soon(rid)
            self.link.forget(rid)  # write-back finishes on its own


def run(settings: Settings) -> int:
    """The `decode` role's entry point (pyproject.toml)."""
    settings, ranks = siblings.start(settings, "decode")  # --data-parallel's other ranks
    worker = DecodeWorker(settings)
    worker.siblings = ranks
    return asyncio.run(worker.serve())
