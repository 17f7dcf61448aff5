"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), `GET` and `DELETE
/v1/responses/{id}`.

A request becomes the chat request it means (convert.py) and runs on the chat path;
its answer is built as output items (output.py). Responses are stored unless
`store` is false (store.py: bounded, expiring, per API key), so `previous_response_id`
continues one: its conversation (every earlier input and output, not its instructions), then
this request's input.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.body import read_model
from router.completions import images
from router.completions.answer import begin, streamed, whole_answer
from router.completions.api import ChatRun, prepare_chat, state_of
from router.completions.openai_format import ChoiceState, Reuse, chat_logprobs
from router.completions.openai_format import usage as chat_usage
from router.completions.protocol import ChatMessage
from router.errors import APIError, bad_request
from router.responses import output as shape
from router.responses.convert import chat_request, flat_param, input_messages, output_messages
from router.responses.output import Output, item_id
from router.responses.protocol import ResponsesRequest
from router.responses.store import Stored, tenant
from router.state import Admission, RouterState, bearer
from services.rpc import worker_pb2 as pb
from services.tracing import Span

routes = APIRouter()


@routes.post("/v1/responses", response_model=None)
async def create(request: Request) -> Response:
    state = state_of(request)
    req = await read_model(request, ResponsesRequest, state.config.max_body_bytes)
    state.check_model(req.model)
    refuse_unserved(req)
    owner = tenant(bearer(request))
    turn = input_messages(req.input)
    if not turn:
        raise bad_request("input is empty", "input")
    conversation = (*earlier(state, owner, req.previous_response_id), *turn)
    rid = item_id("resp")
    try:
        chat = chat_request(req, conversation)
        files = await images.read_all(state.config, state.model.vision, chat.messages)
        run = prepare_chat(state, chat, request, rid, files)
    except APIError as e:
        raise flat_param(e) from e
    answer = Answer(state, req, rid, run, owner, conversation)
    admission, span = await begin(request, state, run.jobs, req.stream)
    if req.stream:
        return streamed(answer.events(admission, span), admission)
    return await whole_answer(request, state, run.jobs, admission, span, answer.whole)


@routes.get("/v1/responses/{response_id}", response_model=None)
async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    stored = state.responses.get(tenant(bearer(request)), response_id)
    if stored is None:
        raise not_found(response_id)
    return stored.body


@routes.delete("/v1/responses/{response_id}", response_model=None)
async def delete(response_id: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    if not state.responses.delete(tenant(bearer(request)), response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def refuse_unserved(req: ResponsesRequest) -> None:
    """What the router does not serve is refused, not ignored: the answer would differ."""
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.conversation is not None:
        raise bad_request(
            "conversations are not supported; continue a response with previous_response_id",
            "conversation",
        )


def earlier(state: RouterState, owner: bytes, response_id: str | None) -> tuple[ChatMessage, ...]:
    """The conversation a follow-up continues (none without previous_response_id)."""
    if response_id is None:
        return ()
    stored = state.responses.get(owner, response_id)
    if stored is None:
        raise APIError(
            404,
            f"Previous response with id '{response_id}' not found.",
            "previous_response_id",
            "previous_response_not_found",
        )
    return stored.conversation


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "response_id", "not_found")


@dataclass
class Answer:
    """One response being made: its output as the text arrives, its body, and (`store`) the
    response kept for follow-ups once it is done."""

    state: RouterState
    req: ResponsesRequest
    rid: str
    run: ChatRun
    owner: bytes
    conversation: tuple[ChatMessage, ...]

    def __post_init__(self) -> None:
        plan = self.run.tool_plan
        self.created = int(time.time())
        self.output = Output(plan.forced, bool(plan.tools), self._logprobs)

    def _logprobs(self, entries: Any) -> list[dict[str, Any]]:
        top = self.run.top
        return [] if top is None else chat_logprobs(self.state.tokenizer, entries, top)["content"]

    def body(
        self, status: str, usage: dict[str, Any] | None = None, error: Any = None
    ) -> dict[str, Any]:
        return shape.body(self.rid, self.created, self.state.model_id, self.req, status,
                          self.output.items, usage, error)  # fmt: skip

    def done(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The finished body, stored for follow-ups unless `store` is false."""
        out = self.body(self.output.status, shape.usage(usage))
        if self.req.store:
            conversation = (*self.conversation, *output_messages(out["output"]))
            self.state.responses.put(self.owner, self.rid, Stored(out, conversation))
        return out

    def whole(self, choices: list[ChoiceState], usage: dict[str, Any]) -> dict[str, Any]:
        (choice,) = choices
        self.output.feed(choice.text, choice.logprobs, choice.finish_reason or "stop")
        return self.done(usage)

    async def events(self, admission: Admission, span: Span) -> AsyncIterator[bytes]:
        """The stream: every event named (`event:`) and numbered (`sequence_number`)."""
        numbered = Numbered()
        yield numbered({"type": "response.created", "response": self.body("in_progress")})
        yield numbered({"type": "response.in_progress", "response": self.body("in_progress")})
        prompt_tokens, completion, cached, reuse = len(self.run.ids), 0, 0, Reuse()
        try:
            async for delta, _ in self.state.run(self.run.jobs, admission, span):
                completion += len(delta.token_ids)
                cached += delta.cached_tokens
                reuse.add(delta.approximate_tokens, delta.recomputed_tokens)
                logprobs: list[pb.TokenLogprobs] = delta.logprobs
                for event in self.output.feed(delta.text, logprobs, delta.finish_reason):
                    yield numbered(event)
            out = self.done(
                chat_usage(prompt_tokens, completion, min(cached, prompt_tokens), reuse)
            )
            # the last event, also when cut by max_output_tokens (status "incomplete"), as vLLM
            # sends it: the openai SDK's stream helper and the Agents SDK take their final
            # response from it (OpenAI itself sends "response.incomplete" there)
            yield numbered({"type": "response.completed", "response": out})
        except APIError as e:  # mid-stream: the response failed, and the stream ends
            error = {"code": e.code or "server_error", "message": e.message}
            failed = self.body("failed", error=error)
            yield numbered({"type": "response.failed", "response": failed})
        finally:
            span.end()


class Numbered:
    """SSE events of one stream, numbered from 0."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, event: dict[str, Any]) -> bytes:
        kind = event["type"]
        data = json.dumps({"type": kind, "sequence_number": self.next, **event}, ensure_ascii=False)
        self.next += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()
