"""How a generation request is answered once validated: admitted among those in flight,
run through the workers, and sent back whole or as a stream; its work cancelled when the
client goes away. The endpoints (api.py, responses/api.py) give the shapes of their answers."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.completions.openai_format import ChoiceState, Envelope, Reuse, sse, usage
from router.completions.protocol import ChatCompletionRequest, CompletionRequest
from router.errors import APIError, bad_request, unavailable
from router.state import Admission, RouterState, watch_disconnect
from router.workers.generation import RETRY_POLL
from router.workers.jobs import Job
from services.tracing import NO_SPAN, RECEIVED, Span

CLIENT_GONE = 499  # the status nginx logs for a client that closed the connection first


def first_choices(jobs: Sequence[Job]) -> frozenset[int]:
    """The response indices of each prompt's first choice: the cached tokens they report are
    what the request found; the others reuse the blocks that choice computed."""
    return frozenset(j.index_base for j in jobs)


Chunk = Callable[[str, ChoiceState, list[Any], bool], list[dict[str, Any]]]
Whole = Callable[[list[ChoiceState], dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Replies:
    """How one endpoint answers: a streamed choice's chunk (its new text or delta), the whole
    body when not streaming, and (chat) the chunk announcing a choice's role first."""

    envelope: Envelope
    chunk: Chunk
    whole: Whole
    role_chunk: Callable[[int], dict[str, Any]] | None = None


async def begin(
    request: Request, state: RouterState, jobs: list[Job], stream: bool
) -> tuple[Admission, Span]:
    """The request admitted (once a worker of every role it needs is available: see
    wait_for_workers; 429 when too many are in flight) and its trace started."""
    await wait_for_workers(request, state)
    admission = state.admit(jobs)
    prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
    span = state.tracer.start(
        f"POST {request.url.path}",
        request.headers.get("traceparent"),
        request_id=jobs[0].request_id.rpartition("-")[0],
        prompt_tokens=prompt_tokens,
        stream=stream,
    )
    span.start_ns = request.scope.get(RECEIVED, span.start_ns)
    span.event("admitted")
    return admission, span


async def wait_for_workers(request: Request, state: RouterState) -> None:
    """Until a worker of every role the request needs is available (all of a role restarting,
    or cut off): up to `retry_wait` seconds, counted in a gauge, then 503 with Retry-After,
    before any stream starts; no wait for a client that has gone."""
    missing = missing_roles(state)
    if not missing:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.retry_wait
    state.metrics.waiting_for_worker.inc()
    try:
        while missing:
            if loop.time() >= deadline:
                raise unavailable(
                    f"no {missing[0]} worker is available (waited {state.config.retry_wait:g}s)",
                    retry_after=1,
                )
            if await request.is_disconnected():
                raise APIError(CLIENT_GONE, "the client closed the request")
            await asyncio.sleep(RETRY_POLL)
            missing = missing_roles(state)
    finally:
        state.metrics.waiting_for_worker.dec()


def missing_roles(state: RouterState) -> list[str]:
    """The roles the request needs that have no worker available now."""
    return [role for role in state.required_roles if not state.registry.available(role)]


def streamed(body: AsyncIterator[bytes], admission: Admission) -> StreamingResponse:
    # a stream the server never starts (the client left first) still gives its place back
    weakref.finalize(body, admission.release)
    return StreamingResponse(body, media_type="text/event-stream")


async def whole_answer(
    request: Request,
    state: RouterState,
    jobs: list[Job],
    admission: Admission,
    span: Span,
    whole: Whole,
) -> Response:
    """The answer in one body, once every choice has finished; the work cancelled if the
    client goes away first."""

    async def collect() -> dict[str, Any]:
        choices: dict[int, ChoiceState] = {}
        cached, firsts, reuse = 0, first_choices(jobs), Reuse()
        async for delta, choice in state.run(jobs, admission, span):
            choices[choice.index] = choice
            if delta.index in firsts:
                cached += delta.cached_tokens
                reuse.add(delta.approximate_tokens, delta.recomputed_tokens)
        ordered = [choices[i] for i in sorted(choices)]
        completion = sum(len(c.token_ids) for c in ordered)
        prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
        return whole(ordered, usage(prompt_tokens, completion, min(cached, prompt_tokens), reuse))

    task = asyncio.create_task(collect())
    watcher = asyncio.create_task(watch_disconnect(request, task))
    try:
        return JSONResponse(await task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():  # the server is stopping
            raise
        return Response(status_code=CLIENT_GONE)  # nobody reads it; counted in /metrics
    finally:
        watcher.cancel()
        admission.release()  # if the task was cancelled before it began
        span.end()


async def respond(
    request: Request,
    state: RouterState,
    req: CompletionRequest | ChatCompletionRequest,
    jobs: list[Job],
    replies: Replies,
) -> Response:
    """A completions or chat answer, streamed as OpenAI's chunks or whole."""
    options = req.stream_options
    if options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    want_usage = options is not None and options.include_usage
    continuous = want_usage and options is not None and options.continuous_usage_stats
    admission, span = await begin(request, state, jobs, req.stream)
    if req.stream:
        prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
        body = stream_events(
            state, jobs, admission, want_usage, replies, prompt_tokens, span, continuous
        )
        return streamed(body, admission)
    return await whole_answer(request, state, jobs, admission, span, replies.whole)


async def stream_events(
    state: RouterState,
    jobs: list[Job],
    admission: Admission,
    want_usage: bool,
    replies: Replies,
    prompt_tokens: int,
    span: Span = NO_SPAN,
    continuous: bool = False,
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed answer; with `continuous` (vLLM's continuous_usage_stats)
    every chunk carries the usage so far, else only the last one (include_usage)."""
    role_chunk = replies.role_chunk
    started: set[int] = set()
    completion, cached, firsts, reuse = 0, 0, first_choices(jobs), Reuse()
    try:
        async for delta, choice in state.run(jobs, admission, span):
            first = choice.index not in started
            if first and role_chunk is not None:
                event = role_chunk(choice.index)
                if want_usage:
                    event["usage"] = None
                yield sse(event)
            started.add(choice.index)
            completion += len(delta.token_ids)
            if delta.index in firsts:
                cached += delta.cached_tokens
                reuse.add(delta.approximate_tokens, delta.recomputed_tokens)
            if (
                delta.text
                or delta.logprobs
                or delta.finish_reason
                or (first and role_chunk is None)
            ):
                for event in replies.chunk(delta.text, choice, delta.logprobs, first):
                    if want_usage:  # so far (vLLM's continuous_usage_stats), or at the end
                        so_far = min(cached, prompt_tokens)
                        event["usage"] = (
                            usage(prompt_tokens, completion, so_far, reuse) if continuous else None
                        )
                    yield sse(event)
                span.event("written", tokens=len(delta.token_ids))
        if want_usage:
            yield sse(
                replies.envelope(
                    [], usage=usage(prompt_tokens, completion, min(cached, prompt_tokens), reuse)
                )
            )
    except APIError as e:  # mid-stream: an error event, then the end of the stream
        yield sse(e.body())
    finally:
        span.end()
    yield sse("[DONE]")
