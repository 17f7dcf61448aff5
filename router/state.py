"""What the router's endpoints share: settings, tokenizer, workers, pipeline, metrics; and the
steps every generation request takes (parse, validate, admit, run, count)."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kvstore.block_hash import ImageSpan
from router.completions.openai_format import ChoiceState
from router.completions.protocol import SamplingFields
from router.completions.structured import grammar_of
from router.console.recent import Recent, StoreRates
from router.errors import APIError, bad_request
from router.metrics import Metrics
from router.responses.store import ResponseStore
from router.workers.generation import Pipeline
from router.workers.jobs import Delta, Job
from router.workers.policy import Policy
from router.workers.registry import Registry
from services.engine.images import spans_of_files
from services.engine.params import SamplingParams, ValidationError
from services.model.config import ModelConfig
from services.model.loading import hf_config, sources
from services.settings import RouterSettings, Settings
from services.tokenizer.tokenizer import Tokenizer
from services.tracing import NO_SPAN, Span, Tracer
from services.worker.convert import USER_FIELDS, to_proto_params


@dataclass
class RouterState:
    settings: Settings  # checked (services.settings.check): secret files read
    tokenizer: Tokenizer
    model: ModelConfig
    model_id: str
    model_root: str
    registry: Registry
    pipeline: Pipeline
    metrics: Metrics = field(default_factory=Metrics)
    tracer: Tracer = field(default_factory=lambda: Tracer("pdserve-router", None))
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's
    recent: Recent = field(default_factory=Recent)  # the console's (router/console/page.py)
    store_rates: StoreRates = field(default_factory=StoreRates)
    pending: int = 0  # sequences (prompts x n) of the requests admitted and not finished
    started: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def create(cls, settings: Settings) -> RouterState:
        r = settings.router
        path = sources.resolve(settings.model.model)
        model = hf_config.read_config(path)
        metrics = Metrics()
        registry = Registry(r, on_health=metrics.health_changed)
        pipeline = Pipeline(
            registry,
            Policy(r),
            r,
            on_local_prefill=lambda reason: metrics.local_prefills.labels(reason).inc(),
            colocated=r.disagg_threshold > model.max_model_len,
        )
        model_id = r.served_model_name or (
            "SmolLM2-135M-Instruct" if settings.model.model == sources.EMBEDDED else path.name
        )
        tokenizer = Tokenizer.from_dir(path)
        recent = Recent()  # the router's spans are always recorded: the console's phases
        tracer = Tracer("pdserve-router", settings.server.trace_file, recent)
        responses = ResponseStore(r.responses_stored, r.responses_ttl)
        return cls(settings, tokenizer, model, model_id, str(path), registry, pipeline, metrics,
                   tracer, responses, recent=recent)  # fmt: skip

    @property
    def config(self) -> RouterSettings:
        """The router's settings."""
        return self.settings.router

    @property
    def colocated(self) -> bool:
        """Every prompt is computed on a decode worker: no prefill worker is needed."""
        return self.pipeline.colocated

    @property
    def required_roles(self) -> tuple[str, ...]:
        """The roles that must have a worker available before a request is taken."""
        return ("decode",) if self.config.disagg_threshold else ("prefill", "decode")

    # -- edge -------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(
                404,
                f"The model `{model}` does not exist (serving `{self.model_id}`)",
                "model",
                "model_not_found",
            )

    def salt(self, request: Request) -> bytes:
        """Per-API-key prefix-cache isolation: tenants never share cached blocks."""
        key = bearer(request)
        return hashlib.sha256(key.encode()).digest()[:16] if key and self.config.api_keys else b""

    def sampling(
        self,
        req: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        best_of: int | None = None,
        grammar: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's parameters; `best_of` choices generated where given (else n); a
        `grammar` forcing tool calls, which no other structured output may join."""
        n = best_of or req.n
        if n > self.config.max_n:
            name = "best_of" if best_of else "n"
            raise bad_request(f"{name} is {n}; at most {self.config.max_n}", name)
        try:
            given = {f: v for f in USER_FIELDS if (v := getattr(req, f)) is not None}
            params = SamplingParams(
                **given,  # a null is the default
                max_tokens=max_tokens,
                logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
                stop=req.stop_strings(),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                n=n,
                logprobs=logprobs,
                grammar=forced_or_asked(grammar, req),
                prompt_logprobs=prompt_logprobs,
            )
            return params.validate(self.model.vocab_size)
        except ValueError as e:  # int() of a logit_bias key, or ValidationError
            field_name = e.field if isinstance(e, ValidationError) else "logit_bias"
            raise bad_request(str(e), field_name) from e

    def check_prompt(self, ids: Sequence[int], max_tokens: int, param: str) -> None:
        limit = self.model.max_model_len
        if not ids:
            raise bad_request("the prompt is empty", param)
        if any(not 0 <= t < self.model.vocab_size for t in ids):
            raise bad_request(f"token ids must be in [0, {self.model.vocab_size})", param)
        if len(ids) + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.",
                param,
            )

    def jobs(
        self,
        rid: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        seed: int | None,
        salt: bytes,
        images: Sequence[bytes] = (),
        kv_reuse: str | None = None,
        chunks: Sequence[Sequence[tuple[int, int]]] = (),
    ) -> list[Job]:
        """One job a prompt; `images`: the one prompt's image files (chat), in order;
        `kv_reuse` (None: the workers'), `chunks`: each prompt's (router/completions/chunks.py)."""
        seed = random.getrandbits(63) if seed is None else seed
        wire = to_proto_params(params)
        spans = self.image_spans(prompts[0], images) if images else ()
        return [
            Job(
                f"{rid}-{i}",
                ids,
                wire,
                seed,
                params.n,
                salt,
                i * params.n,
                self.pipeline.block_hashes(ids, salt, spans),
                images,
                kv_reuse or "",
                tuple(chunks[i]) if chunks else (),
            )
            for i, ids in enumerate(prompts)
        ]

    def image_spans(self, ids: Sequence[int], images: Sequence[bytes]) -> tuple[ImageSpan, ...]:
        """The prompt's image places, named as the workers name them (their digests)."""
        assert self.model.vision is not None  # images.read_all refused images otherwise
        try:
            return spans_of_files(ids, self.model.vision, images)
        except ValidationError as e:
            raise bad_request(e.message, "messages") from None

    # -- running ---------------------------------------------------------------------

    def admit(self, jobs: Sequence[Job]) -> Admission:
        """Places for the request's sequences (prompts x n) among those in flight: 429 when
        they do not fit now, 400 when they never could."""
        seqs = sum(job.n for job in jobs)
        limit = self.config.max_pending
        if seqs > limit:
            raise bad_request(
                f"the request asks for {seqs} sequences (prompts x n); at most {limit} run at "
                "once: send fewer prompts or a smaller n",
                "n",
            )
        if self.pending + seqs > limit:
            raise APIError(
                429,
                "Too many requests in flight; retry shortly",
                None,
                "rate_limit_exceeded",
                {"Retry-After": "1"},
            )
        self.shed(jobs)
        self.pending += seqs
        self.metrics.waiting.inc()
        return Admission(self, seqs)

    def shed(self, jobs: Sequence[Job]) -> None:
        """429 for a request whose prompts would wait past the TTFT SLO wherever they went."""
        slo = self.config.ttft_slo
        if not slo:
            return
        wait = self.pipeline.expected_wait(jobs)
        if wait > slo:
            self.metrics.shed.inc()
            raise APIError(
                429,
                f"The server is overloaded: the prompt would wait {wait:.1f}s for its first "
                f"token (limit {slo:g}s); retry later",
                None,
                "rate_limit_exceeded",
                {"Retry-After": str(max(1, math.ceil(wait - slo)))},
            )

    def _inter_token(self, n: int, now: float, last: float | None) -> None:
        """One gap per token after a choice's first: n tokens arriving together (speculative
        decoding) share the gap since the last ones; a first delta's extra tokens, 0 each."""
        gaps = [(now - last) / n] * n if last is not None else [0.0] * (n - 1)
        for gap in gaps:
            self.metrics.itl.observe(gap)

    async def run(
        self, jobs: Sequence[Job], admission: Admission, span: Span = NO_SPAN
    ) -> AsyncIterator[tuple[Delta, ChoiceState]]:
        """Deltas with their choice's accumulated state; timing and token metrics recorded;
        the admission released at the end, however it comes."""
        start = time.perf_counter()
        choices: dict[int, ChoiceState] = {}
        last: dict[int, float] = {}
        cached = stored = approximate = recomputed = 0
        try:
            async for delta in self.pipeline.run(jobs, span):
                now = time.perf_counter()
                if not admission.streaming:
                    admission.start_streaming()
                    self.metrics.ttft.observe(now - start)
                if delta.token_ids:
                    self._inter_token(len(delta.token_ids), now, last.get(delta.index))
                    last[delta.index] = now
                cached += delta.cached_tokens
                stored += delta.store_tokens
                approximate += delta.approximate_tokens
                recomputed += delta.recomputed_tokens
                state = choices.setdefault(delta.index, ChoiceState(delta.index))
                state.text += delta.text
                state.token_ids += delta.token_ids
                state.logprobs += delta.logprobs
                state.prompt_logprobs += delta.prompt_logprobs
                state.finish_reason = delta.finish_reason or state.finish_reason
                yield delta, state
            self.metrics.e2e.observe(time.perf_counter() - start)
            prompt = sum(len(j.prompt_ids) for j in jobs)
            generated = sum(len(c.token_ids) for c in choices.values())
            queried = sum(len(j.prompt_ids) * j.n for j in jobs)
            self.metrics.finished(
                prompt, generated, queried, cached, stored, (approximate, recomputed)
            )
        finally:
            admission.release()


@dataclass
class Admission:
    """One request counted in flight (and in the waiting, then running gauge) until
    released; releasing twice is harmless."""

    state: RouterState
    seqs: int = 1  # places it holds in RouterState.pending
    streaming: bool = False
    released: bool = False

    def start_streaming(self) -> None:
        self.streaming = True
        self.state.metrics.waiting.dec()
        self.state.metrics.running.inc()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.pending -= self.seqs
            (self.state.metrics.running if self.streaming else self.state.metrics.waiting).dec()


def forced_or_asked(forced: str | None, req: SamplingFields) -> str | None:
    """The grammar forcing tool calls, else the one asked for. A response_format (or vLLM's
    structured outputs) shapes an answer's text, and an answer whose calls are forced has
    none; so both may be given, as OpenAI takes them (the Agents SDK sends both when an agent
    with an output type must call a tool first). The format is still checked (400 if bad)."""
    asked = grammar_of(req)
    return forced or asked


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def watch_disconnect(request: Request, task: asyncio.Task[Any]) -> None:
    """Cancel `task` (a request's work) when the client goes away."""
    while not task.done():
        if await request.is_disconnected():
            task.cancel()
            return
        await asyncio.sleep(0.1)
