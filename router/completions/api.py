"""The OpenAI generation endpoints: /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.body import read_model
from router.completions import images, tools
from router.completions.answer import Replies, respond
from router.completions.chunks import message_spans, separated
from router.completions.forced_calls import ForcedCalls
from router.completions.openai_format import (
    ChoiceState,
    Envelope,
    PromptScores,
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    usage,
)
from router.completions.protocol import ChatCompletionRequest, CompletionRequest
from router.errors import bad_request
from router.state import RouterState, new_id
from router.workers.jobs import Job
from services.engine.params import DEFAULT_MAX_TOKENS

routes = APIRouter()


def state_of(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


@routes.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    state = state_of(request)
    req = await read_model(request, CompletionRequest, state.config.max_body_bytes)
    state.check_model(req.model)
    prompts, chunks = prompt_ids(state, req.prompt, req.chunk_separator)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 scores the prompt: it needs echo", "max_tokens")
    score_only = max_tokens == 0  # one token is generated, and dropped
    for ids in prompts:
        state.check_prompt(ids, max(max_tokens, 1), "prompt")
    echo_scores = req.echo and req.logprobs is not None
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({req.n})", "best_of")
    if best_of > req.n and req.stream:
        raise bad_request("best_of cannot be used with stream", "best_of")
    ranked = best_of > req.n  # the sampled tokens' logprobs are needed to rank the choices
    logprobs = (req.logprobs or 0) if ranked else req.logprobs
    wanted = [
        k for k in (req.prompt_logprobs, req.logprobs if echo_scores else None) if k is not None
    ]
    params = state.sampling(
        req,
        max(max_tokens, 1),
        logprobs,
        best_of if ranked else None,
        prompt_logprobs=max(wanted) if wanted else None,
    )
    rid = new_id("cmpl")
    salt = state.salt(request)
    jobs = state.jobs(rid, prompts, params, req.seed, salt, (), req.kv_reuse, chunks)
    echo = (
        [state.tokenizer.decode(ids) for ids in prompts for _ in range(req.n)] if req.echo else []
    )
    envelope = Envelope(rid, "text_completion", int(time.time()), state.model_id)
    scores = PromptScores(state.tokenizer, prompts, req.logprobs or 0)

    def chunk(
        delta_text: str, state_: ChoiceState, logprobs: list[Any], first: bool
    ) -> list[dict[str, Any]]:
        prompt = state_.index // req.n
        scores.collect(prompt, state_)
        if score_only:
            delta_text, logprobs = "", []
        text = (echo[state_.index] if echo and first else "") + delta_text
        lp = None
        if req.logprobs is not None:
            offset = len(echo[state_.index]) if echo else 0
            if not first:
                offset += len(state_.text) - len(delta_text)
            lp = completion_logprobs(state.tokenizer, logprobs, offset)
            if echo_scores and first:
                lp = scores.prepend(prompt, lp)
        out = envelope.choice(state_.index, state_.finish_reason, lp, text=text)
        if req.prompt_logprobs is not None and first:
            out["choices"][0]["prompt_logprobs"] = scores.vllm(prompt, req.prompt_logprobs)
        return [out]

    def whole(choices: list[ChoiceState], usage_: dict[str, Any]) -> dict[str, Any]:
        for c in choices:
            scores.collect(c.index // best_of, c)
        if score_only:
            choices = [replace(c, text="", token_ids=[], logprobs=[]) for c in choices]
            cached = usage_["prompt_tokens_details"]["cached_tokens"]
            usage_ = usage(usage_["prompt_tokens"], 0, cached)
        if ranked:
            choices = best_choices(choices, best_of, req.n)
        body = completion_body(
            envelope, choices, state.tokenizer, req.logprobs is not None, echo, usage_
        )
        for c, out in zip(choices, body["choices"], strict=True):
            if echo_scores:
                out["logprobs"] = scores.prepend(c.index // req.n, out["logprobs"])
            if req.prompt_logprobs is not None:
                out["prompt_logprobs"] = scores.vllm(c.index // req.n, req.prompt_logprobs)
        return body

    return await respond(request, state, req, jobs, Replies(envelope, chunk, whole))


@routes.post("/v1/chat/completions", response_model=None)
async def chat(request: Request) -> Response:
    state = state_of(request)
    req = await read_model(request, ChatCompletionRequest, state.config.max_body_bytes)
    state.check_model(req.model)
    rid = new_id("chatcmpl")
    files = await images.read_all(state.config, state.model.vision, req.messages)
    run = prepare_chat(state, req, request, rid, files)
    tool_plan, top, scores = run.tool_plan, run.top, PromptScores(state.tokenizer, [run.ids], 0)
    envelope = Envelope(rid, "chat.completion.chunk", int(time.time()), state.model_id)
    splitters: dict[int, tools.CallSplitter] = {}
    forced = tool_plan.forced  # forced calls: the output is the calls alone
    readers: dict[int, ForcedCalls] = {}

    def chunk(
        delta_text: str, state_: ChoiceState, logprobs: list[Any], first: bool
    ) -> list[dict[str, Any]]:
        lp = chat_logprobs(state.tokenizer, logprobs, top or 0) if req.logprobs else None
        finish = state_.finish_reason
        if forced is not None:
            reader = readers.setdefault(state_.index, ForcedCalls(forced, tools.call_id))
            events = [
                envelope.choice(
                    state_.index, None, lp if k == 0 else None, delta={"tool_calls": [d]}
                )
                for k, d in enumerate(reader.deltas(delta_text))
            ]
            if finish is not None:
                reason = "tool_calls" if finish == "stop" else finish
                events.append(envelope.choice(state_.index, reason, None, delta={}))
            return events
        if not tool_plan.tools:
            delta = {"content": delta_text} if delta_text or not finish else {}
            return [envelope.choice(state_.index, finish, lp, delta=delta)]
        splitter = splitters.setdefault(state_.index, tools.CallSplitter())
        start = len(splitter.calls)
        text, calls = splitter.feed(delta_text, final=finish is not None)
        events = [envelope.choice(state_.index, None, lp, delta={"content": text})] if text else []
        for k, call in enumerate(calls, start):
            events += tool_call_chunks(envelope, state_.index, k, call)
        if finish is not None:
            reason = "tool_calls" if splitter.calls and finish == "stop" else finish
            events.append(envelope.choice(state_.index, reason, None, delta={}))
        return events

    def whole(choices: list[ChoiceState], usage_: dict[str, Any]) -> dict[str, Any]:
        body = chat_body(
            envelope, choices, state.tokenizer, (top or 0) if req.logprobs else None, usage_
        )
        if req.prompt_logprobs is not None:
            scores.collect(0, choices[0])
            body["prompt_logprobs"] = scores.vllm(0, req.prompt_logprobs)
        if forced is not None:  # calls, also when cut by max_tokens (their arguments so far)
            for c, out in zip(choices, body["choices"], strict=True):
                reader = ForcedCalls(forced, tools.call_id)
                reader.deltas(c.text)
                out["message"]["content"] = None
                if reader.calls:
                    out["message"]["tool_calls"] = reader.tool_calls()
                out["finish_reason"] = (
                    "tool_calls" if c.finish_reason == "stop" else (c.finish_reason)
                )
        elif tool_plan.tools:
            for c, out in zip(choices, body["choices"], strict=True):
                out["message"]["content"], calls = tools.split_whole(c.text)
                if calls:
                    out["message"]["tool_calls"] = calls
                    if c.finish_reason == "stop":
                        out["finish_reason"] = "tool_calls"
        return body

    def role_chunk(index: int) -> dict[str, Any]:
        return envelope.choice(index, None, None, delta={"role": "assistant", "content": ""})

    replies = Replies(envelope, chunk, whole, role_chunk)
    return await respond(request, state, req, run.jobs, replies)


@dataclass(frozen=True)
class ChatRun:
    """A chat request made ready to run: its prompt, what its tools change, its jobs."""

    ids: list[int]
    tool_plan: tools.ToolPlan
    jobs: list[Job]
    top: int | None  # top_logprobs shown per token; None: no logprobs asked


def prepare_chat(
    state: RouterState,
    req: ChatCompletionRequest,
    request: Request,
    rid: str,
    files: Sequence[bytes] = (),
) -> ChatRun:
    """The request's tools checked, its messages templated, its parameters validated (400
    naming the field), and its job: what chat completions and Responses share. `files`: the
    messages' images (images.read_all), in order."""
    tool_plan = tools.plan(req)
    has_tools = state.tokenizer.template_has_tools
    vision = state.model.vision if files else None
    image_text = images.image_text(state.tokenizer, vision) if vision else None
    messages = tools.template_messages(req.messages, tool_plan.tools, has_tools, image_text)
    offered = [t.model_dump(exclude_none=True) for t in tool_plan.tools] if has_tools else None
    try:
        text = state.tokenizer.render_chat(messages, req.add_generation_prompt, tools=offered)
    except ValueError as e:
        raise bad_request(f"the chat template refused the messages: {e}", "messages") from e
    chunks: list[tuple[int, int]] = []
    if vision is not None:
        text = images.expand(text, state.tokenizer, vision, len(files))
        ids = state.tokenizer.encode(text, add_special_tokens=False)
    else:
        spans = message_spans(text, req.messages)
        ids, chunks = state.tokenizer.encode_marked(text, spans, add_special_tokens=False)
    limit = state.model.max_model_len
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, limit - len(ids))
    state.check_prompt(ids, max_tokens, "messages")
    top = req.top_logprobs if req.logprobs else None
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if req.logprobs else None
    params = state.sampling(
        req, max_tokens, logprobs, grammar=tool_plan.grammar, prompt_logprobs=req.prompt_logprobs
    )
    salt = state.salt(request)
    jobs = state.jobs(rid, [ids], params, req.seed, salt, files, req.kv_reuse, [chunks])
    return ChatRun(ids, tool_plan, jobs, top)


def tool_call_chunks(
    envelope: Envelope, index: int, k: int, call: dict[str, Any]
) -> list[dict[str, Any]]:
    """A tool call streamed as OpenAI streams one: its id, type and name first, then its
    arguments."""
    fn = call["function"]
    head = {"index": k, "id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": ""}}  # fmt: skip
    arguments = {"index": k, "function": {"arguments": fn["arguments"]}}
    return [
        envelope.choice(index, None, None, delta={"tool_calls": [head]}),
        envelope.choice(index, None, None, delta={"tool_calls": [arguments]}),
    ]


def best_choices(choices: list[ChoiceState], best_of: int, n: int) -> list[ChoiceState]:
    """Of each prompt's `best_of` choices, the n with the highest cumulative logprob, best
    first, numbered as if only n had been asked for."""
    out: list[ChoiceState] = []
    for first in range(0, len(choices), best_of):
        group = sorted(choices[first : first + best_of], key=lambda c: -cumulative_logprob(c))
        base = first // best_of * n
        out += [replace(c, index=base + rank) for rank, c in enumerate(group[:n])]
    return out


def cumulative_logprob(choice: ChoiceState) -> float:
    return sum(e.logprob for e in choice.logprobs)


def prompt_ids(
    state: RouterState,
    prompt: str | list[str] | list[int] | list[list[int]],
    separator: str | None = None,
) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """A completion prompt in any of its four forms, as token id lists, and each one's chunks
    (text prompts' pieces between `separator`s: router/completions/chunks.py)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)], [[]]  # type: ignore[arg-type]
    if len(prompt) > state.config.max_prompts:
        raise bad_request(
            f"{len(prompt)} prompts in one request; at most {state.config.max_prompts}", "prompt"
        )
    if all(isinstance(p, str) for p in prompt):
        marked = [state.tokenizer.encode_marked(p, separated(p, separator)) for p in prompt]  # type: ignore[arg-type]
        return [ids for ids, _ in marked], [chunks for _, chunks in marked]
    return [list(p) for p in prompt], [[] for _ in prompt]  # type: ignore[arg-type]
