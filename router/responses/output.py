"""A Responses answer's output, built as the model's text arrives: output items (an assistant
message, function calls) and the stream events that build them, in OpenAI's order:

    response.created, response.in_progress
    per item:  response.output_item.added
               message:        response.content_part.added, response.output_text.delta ...,
                               response.output_text.done, response.content_part.done
               function_call:  response.function_call_arguments.delta ...,
                               response.function_call_arguments.done
               response.output_item.done
    response.completed, with usage (status "incomplete" when cut by max_output_tokens)

The text is read as chat reads it (completions/tools.py, forced_calls.py): a forced
tool_choice's output is the calls alone, "auto" parses the <tool_call> blocks the model
writes. A whole (not streamed) answer is the same text fed at once, so both give the same
items.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from router.completions import tools
from router.completions.forced_calls import Forced, ForcedCalls
from router.responses.protocol import ResponsesRequest
from services.rpc import worker_pb2 as pb

Event = dict[str, Any]  # a stream event's type and fields (the sequence number added later)
Logprobs = Callable[[Sequence[pb.TokenLogprobs]], list[dict[str, Any]]]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """One answer's output items; `feed` takes the text (and its tokens' logprobs) as it
    arrives and returns the events it makes."""

    def __init__(self, forced: Forced | None, with_tools: bool, logprobs: Logprobs) -> None:
        self.items: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self._logprobs = logprobs
        self._open: dict[str, Any] | None = None  # the item still growing (the last one)
        self._calls = ForcedCalls(forced, tools.call_id) if forced is not None else None
        self._splitter = tools.CallSplitter() if with_tools and forced is None else None

    def feed(
        self, text: str, logprobs: Sequence[pb.TokenLogprobs], finish: str | None
    ) -> list[Event]:
        events: list[Event] = []
        if self._calls is not None:
            for delta in self._calls.deltas(text):
                if "id" in delta:  # a new call's head
                    name = delta["function"]["name"]
                    events += self._close() + self._open_call(delta["id"], name)
                else:
                    events.append(self._grow_call(delta["function"]["arguments"]))
        elif self._splitter is not None:
            shown, calls = self._splitter.feed(text, final=finish is not None)
            if shown:
                events += self._text(shown, logprobs)
            for call in calls:
                fn = call["function"]
                events += self._close() + self._open_call(call["id"], fn["name"])
                events.append(self._grow_call(fn["arguments"]))
        elif text or logprobs:
            events += self._text(text, logprobs)
        if finish is not None:
            self.finish_reason = finish
            events += self._close("incomplete" if finish == "length" else "completed")
        return events

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def _text(self, text: str, logprobs: Sequence[pb.TokenLogprobs]) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item["type"] != "message":
            events += self._close()
            empty: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [],
                                     "logprobs": []}  # fmt: skip
            item = {"type": "message", "id": item_id("msg"), "status": "in_progress",
                    "role": "assistant", "content": [empty]}  # fmt: skip
            events += self._add(item)
            events.append(self._at("response.content_part.added", item, part=copy.deepcopy(empty)))
        part = item["content"][0]
        entries = self._logprobs(logprobs)
        part["text"] += text
        part["logprobs"] += entries
        events.append(self._at("response.output_text.delta", item, delta=text, logprobs=entries))
        return events

    def _open_call(self, call_id: str, name: str) -> list[Event]:
        item: dict[str, Any] = {"type": "function_call", "id": item_id("fc"), "call_id": call_id,
                                "name": name, "arguments": "", "status": "in_progress"}  # fmt: skip
        return self._add(item)

    def _grow_call(self, piece: str) -> Event:
        item = self._open
        assert item is not None and item["type"] == "function_call"
        item["arguments"] += piece
        return self._at("response.function_call_arguments.delta", item, delta=piece)

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": copy.deepcopy(item),
            }
        ]

    def _close(self, status: str = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self._at(
                    "response.output_text.done", item, text=part["text"], logprobs=part["logprobs"]
                ),
                self._at("response.content_part.done", item, part=copy.deepcopy(part)),
            ]
        else:
            events = [
                self._at(
                    "response.function_call_arguments.done",
                    item,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        index = len(self.items) - 1
        done = {"type": "response.output_item.done", "output_index": index, "item": item}
        return [*events, copy.deepcopy(done)]

    def _at(self, kind: str, item: dict[str, Any], **fields: Any) -> Event:
        """An event about the last item (its id and index; a message's one content part)."""
        where: Event = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            where["content_index"] = 0
        return {"type": kind, **where, **fields}


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage as the Responses API counts it."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": chat_usage["prompt_tokens_details"],
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def body(
    rid: str,
    created: int,
    model: str,
    req: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    usage_: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response object: its status and output, and the request's settings it echoes."""
    fmt = req.text.format if req.text is not None else None
    choice = req.tool_choice
    tool_choice = choice.model_dump() if choice and not isinstance(choice, str) else choice
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True) if fmt else {"type": "text"}},
        "tool_choice": tool_choice or "auto",
        "tools": [t.model_dump() for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": usage_,
        "user": req.user,
    }
