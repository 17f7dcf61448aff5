"""One request through the workers: Prefill on a prefill worker, then Decode on a decode
worker, for each choice, hiding worker faults from the client.

- Prefill fails or times out: tried again on another prefill worker, or on one that failed
  and has come back since (restarted); when none is left for `retry_wait` seconds, 503 with
  Retry-After (docs/design.md).
- A prompt expected to wait past `ttft_slo` seconds for a prefill worker goes to a decode
  worker that would compute it sooner (router/workers/backlog.py estimates the waits); the admission
  refuses (429) a request neither could start in time.
- The KV store is down (Prefill answers UNAVAILABLE "kv store"): the choice goes to a decode
  worker that computes the prompt itself (local prefill).
- A decode worker dies mid-stream: Decode is issued again on another decode worker with the
  tokens (and text) already sent; the client's stream goes on with no gap and no duplicate.
- The consumer stops reading (client gone): every RPC of the request is cancelled, and the
  workers free its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from kvstore.block_hash import BLOCK_SIZE, ImageSpan, block_hashes
from router.errors import APIError, bad_request, unavailable
from router.workers import encoding
from router.workers.calls import int64, raise_stream_ended, trace_metadata
from router.workers.jobs import Delta, Job
from router.workers.policy import Policy
from router.workers.quiet_calls import QuietCalls
from router.workers.registry import Registry, Tried, WorkerState
from services.engine.seeds import choice_seed
from services.rpc import worker_pb2 as pb
from services.settings import RouterSettings
from services.tracing import CLIENT, NO_SPAN, Span
from services.worker.convert import FINISH_NAMES

log = logging.getLogger("pdserve.router")
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS)
RETRY_POLL = 0.25  # seconds between looks for a worker to come back
MAX_FAILURES = 6  # worker failures one call survives (a worker in a crash loop ends it)


class Pipeline:
    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        settings: RouterSettings,
        on_local_prefill: Callable[[str], None] = lambda reason: None,
        colocated: bool = False,
    ) -> None:
        """`settings.ttft_slo` 0: no prompt spills to decode, none is refused."""
        self.registry = registry
        self.policy = policy
        self.settings = settings
        self.colocated = colocated  # every prompt is computed on a decode worker
        self.on_local_prefill = on_local_prefill  # called with why a decode worker prefills
        self.quiet = QuietCalls()  # Prefetch and its Abort: calls nobody waits for

    def block_hashes(
        self, prompt_ids: Sequence[int], salt: bytes, images: Sequence[ImageSpan] = ()
    ) -> list[bytes]:
        """A prompt's block hashes (the partial last one too) as the workers name them."""
        ns = self.registry.namespace
        return block_hashes(prompt_ids, BLOCK_SIZE, ns, salt, True, images)

    async def run(self, jobs: Sequence[Job], span: Span = NO_SPAN) -> AsyncIterator[Delta]:
        """Deltas of every choice of every job, interleaved as they arrive. Choice 0 of each
        job runs first; the others start once its prompt is prefilled, so they find the
        prompt's blocks cached instead of computing them again."""
        queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        tasks = [asyncio.create_task(self._job(job, queue, span)) for job in jobs]
        remaining = sum(job.n for job in jobs)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _job(self, job: Job, queue: asyncio.Queue[Delta | BaseException], span: Span) -> None:
        prefilled = asyncio.Event()
        choices = [asyncio.create_task(self._choice(job, 0, queue, span, prefilled))]
        try:
            await prefilled.wait()
            choices += [
                asyncio.create_task(self._choice(job, i, queue, span)) for i in range(1, job.n)
            ]
            await asyncio.gather(*choices)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            prefilled.set()
            queue.put_nowait(e)
        finally:  # cancelled (the client left) or failed: no choice runs on, not even a prefill
            for task in choices:
                task.cancel()
            await asyncio.gather(*choices, return_exceptions=True)

    async def _choice(
        self,
        job: Job,
        index: int,
        queue: asyncio.Queue[Delta | BaseException],
        span: Span,
        prefilled: asyncio.Event | None = None,
    ) -> None:
        rid = f"{job.request_id}-{index}"
        seed = int64(choice_seed(job.seed, index))
        out = job.index_base + index
        early: WorkerState | None = None  # the decode worker reading the prompt's KV early
        encode = None  # choice 0's images on their way to encoders, once
        try:
            reply = None
            if job.images and prefilled is not None and self.registry.available("encode"):
                timeout = self.settings.encode_timeout
                encode = asyncio.ensure_future(
                    encoding.encode(self.registry, rid, job.wire_images, timeout, span)
                )
            if self._compute_on_decode(job):
                self.on_local_prefill("colocated" if self.colocated else "short_prompt")
            elif self._spill(job):
                self.on_local_prefill("prefill_backlog")
            else:
                early = self._prefetch(rid, job) if prefilled is not None else None
                waiting = job.images_being_encoded(round(self.settings.encode_timeout * 1000))
                reply = await encoding.beside(
                    encode, lambda r, images: self._prefill(r, job, seed, span, images), rid,
                    waiting,
                )  # fmt: skip
                encode = None
            if encode is not None:  # the decode worker computes the prompt: rows first
                await encode
            if prefilled is not None:
                prefilled.set()
            tokens: list[int] = []
            text_sent = 0
            if reply is not None:
                tokens, text_sent = [reply.first_token], len(reply.text)
                finish = FINISH_NAMES.get(reply.finish_reason)
                queue.put_nowait(
                    Delta(
                        out,
                        tokens[:],
                        reply.text,
                        [reply.first_logprobs] if reply.HasField("first_logprobs") else [],
                        finish,
                        reply.cached_tokens,
                        reply.store_tokens,
                        list(reply.prompt_logprobs),
                        reply.approximate_tokens,
                        reply.recomputed_tokens,
                    )
                )
                if finish is not None:
                    return
            decode = self._decode(rid, job, seed, tokens, text_sent, reply is None, span, early)
            early = None  # the Decode claims the prefetch, or aborts it
            async for delta in decode:
                delta.index = out
                queue.put_nowait(delta)
        finally:
            if encode is not None:
                encode.cancel()
            if prefilled is not None:
                prefilled.set()
            self.quiet.abort(early, rid)  # no Decode came (finished, failed, cancelled)

    def _prefetch(self, rid: str, job: Job) -> WorkerState | None:
        """The decode worker the prompt will go to, asked to read its blocks as the prefill
        writes them (decode/prefetch.py); None for a prompt it would read quickly anyway."""
        minimum = self.settings.prefetch_tokens
        candidates = self.registry.available("decode")
        if not minimum or len(job.prompt_ids) < minimum or not candidates or job.images:
            return None  # (a prompt with images: its Decode reads what the prefill wrote)
        worker = self.policy.pick(candidates, job.block_hashes)
        if self._uncached(worker, job) < minimum:
            return None
        request = pb.PrefetchRequest(request_id=rid, prompt_token_ids=job.prompt_ids, salt=job.salt)
        self.quiet.prefetch(worker, request)
        return worker

    def _compute_on_decode(self, job: Job) -> bool:
        """Conditional disaggregation: a prompt whose uncached part is short skips prefill."""
        threshold = self.settings.disagg_threshold
        if not threshold:
            return False
        if threshold > len(job.prompt_ids):  # whatever is cached
            return True
        decoders = self.registry.available("decode")
        cached = max((w.cached_prefix(job.block_hashes) for w in decoders), default=0)
        return len(job.prompt_ids) - cached * BLOCK_SIZE < threshold

    def expected_wait(self, jobs: Sequence[Job]) -> float:
        """Seconds the request's prompts would wait for their first tokens on the worker of
        either role that would compute them soonest (0 with none available)."""
        wait = self._best_wait(("prefill", "decode"), jobs)
        return 0.0 if wait == float("inf") else wait

    def _spill(self, job: Job) -> bool:
        """The prompt would start sooner on a decode worker, and past the TTFT SLO on every
        prefill worker."""
        slo = self.settings.ttft_slo
        if not slo:
            return False
        prefill = self._best_wait(("prefill",), [job])
        return prefill > slo and self._best_wait(("decode",), [job]) < prefill

    def _best_wait(self, roles: Sequence[str], jobs: Sequence[Job]) -> float:
        """The shortest expected wait for the jobs' prompts on one worker of these roles."""
        waits = [
            w.backlog.wait(sum(self._uncached(w, job) for job in jobs))
            for role in roles
            for w in self.registry.available(role)
        ]
        return min(waits, default=float("inf"))

    def _uncached(self, worker: WorkerState, job: Job) -> int:
        """Prompt tokens the worker would compute, as far as the router knows its cache."""
        return max(0, len(job.prompt_ids) - worker.cached_prefix(job.block_hashes) * BLOCK_SIZE)

    async def _prefill(
        self, rid: str, job: Job, seed: int, span: Span, images: list[pb.Image] | None = None
    ) -> pb.PrefillReply | None:
        """The prefill reply; None when the KV store is down (the decode worker computes).
        `images`: as the worker gets them (by default, as files alone)."""
        request = pb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=job.prompt_ids,
            params=job.params,
            seed=seed,
            salt=job.salt,
            images=job.wire_images if images is None else images,
            kv_reuse=job.kv_reuse,
            chunks=job.wire_chunks,
        )
        tried = Tried()
        while True:
            worker = await self._pick("prefill", job.block_hashes, tried, job.reuse_chunks)
            worker.inflight += 1
            sent, computed = self._uncached(worker, job), 0
            worker.backlog.add(sent)
            call = span.child("Prefill", CLIENT, worker=worker.address, request_id=rid)
            try:
                reply: pb.PrefillReply = await worker.stub.Prefill(
                    request, timeout=self.settings.prefill_timeout, metadata=trace_metadata(call)
                )
                computed = len(job.prompt_ids) - reply.cached_tokens
            except grpc.aio.AioRpcError as e:
                if e.code() in REFUSED:
                    raise bad_request(e.details() or "refused by the worker") from e
                if e.code() == grpc.StatusCode.UNAVAILABLE and "kv store" in (e.details() or ""):
                    log.warning(
                        "kv store down: prefilling on a decode worker",
                        extra={"fields": {"request_id": rid}},
                    )
                    self.on_local_prefill("kv_store_down")
                    return None
                self.registry.failed(worker, f"{e.code().name}: {e.details()}")
                tried.add(worker)
                continue
            finally:
                worker.inflight -= 1
                worker.backlog.answered(sent, computed)
                call.end()
            self.registry.succeeded(worker)
            worker.remember(job.block_hashes, job.reuse_chunks)
            return reply

    async def _decode(
        self,
        rid: str,
        job: Job,
        seed: int,
        tokens: list[int],
        text_sent: int,
        local_prefill: bool,
        span: Span,
        preferred: WorkerState | None = None,
    ) -> AsyncIterator[Delta]:
        """`local_prefill`: the decode worker computes the prompt (no prefill ran);
        `preferred`: the worker prefetching the prompt, taken if it is still available."""
        tried = Tried()
        first = local_prefill
        while True:
            usable = any(w is preferred for w in self.registry.available("decode"))
            if preferred is not None and usable and tried.allows(preferred):
                worker = preferred
            else:
                worker = await self._pick("decode", job.block_hashes, tried, job.reuse_chunks)
                if worker is not preferred:
                    self.quiet.abort(preferred, rid)
            preferred = None
            request = pb.DecodeRequest(
                request_id=rid,
                prompt_token_ids=job.prompt_ids,
                output_token_ids=tokens,
                params=job.params,
                seed=seed,
                salt=job.salt,
                local_prefill=local_prefill,
                text_sent=text_sent,
                images=job.wire_images,
                kv_reuse=job.kv_reuse,
                chunks=job.wire_chunks,
            )
            traced = span.child("Decode", CLIENT, worker=worker.address, request_id=rid)
            call = worker.stub.Decode(request, metadata=trace_metadata(traced))
            worker.inflight += 1
            sent = self._uncached(worker, job) if first else 0  # it computes the prompt
            worker.backlog.add(sent)
            try:
                async for chunk in call:
                    traced.event("chunk", tokens=len(chunk.token_ids))
                    if sent:
                        worker.backlog.answered(sent, sent)
                        sent = 0
                    tokens += chunk.token_ids
                    text_sent += len(chunk.text)
                    finish = FINISH_NAMES.get(chunk.finish_reason)
                    usage = chunk.usage if first and finish else pb.Usage()
                    yield Delta(
                        0,
                        list(chunk.token_ids),
                        chunk.text,
                        list(chunk.logprobs),
                        finish,
                        usage.cached_tokens,
                        usage.store_tokens,
                        list(chunk.prompt_logprobs),
                        usage.approximate_tokens,
                        usage.recomputed_tokens,
                    )
                    if finish is not None:
                        self.registry.succeeded(worker)
                        worker.remember(job.block_hashes, job.reuse_chunks)
                        return
                raise_stream_ended(worker)
            except grpc.aio.AioRpcError as e:
                if e.code() in REFUSED:
                    raise bad_request(e.details() or "refused by the worker") from e
                self.registry.failed(worker, f"{e.code().name}: {e.details()}")
                tried.add(worker)
                log.warning(
                    "decode worker lost mid-stream: migrating",
                    extra={
                        "fields": {
                            "request_id": rid,
                            "worker": worker.address,
                            "tokens_sent": len(tokens),
                        }
                    },
                )
            finally:
                worker.inflight -= 1
                worker.backlog.answered(sent, 0)
                traced.end()
                call.cancel()

    async def _pick(
        self,
        role: str,
        hashes: Sequence[bytes],
        tried: Tried,
        chunks: Sequence[tuple[bytes, int]] = (),
    ) -> WorkerState:
        """A worker this request has not given up on; with none (all failed it, or none of
        the role is available), waits up to `retry_wait` seconds for one to come back; 503
        when none does."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.retry_wait
        while tried.failures < MAX_FAILURES:
            candidates = [w for w in self.registry.available(role) if tried.allows(w)]
            if candidates:
                return self.policy.pick(candidates, hashes, chunks)
            if loop.time() >= deadline:
                break
            await asyncio.sleep(RETRY_POLL)
        raise unavailable(f"no {role} worker can serve the request", retry_after=1)


__all__ = ["APIError", "Pipeline"]
