"""One streamed request to any OpenAI-compatible server, timed chunk by chunk.

Token counts come from the server's usage (asked for with `stream_options.include_usage`);
a server that sends none is counted with the tokenizer. A failure (an HTTP error, a dropped
connection, an error event, a stream cut short) is recorded with its reason, never raised.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from bench.load.metrics import RequestRecord
from bench.load.workloads import SEPARATOR, Conversation, Tokenizer, Turn


@dataclass(frozen=True)
class Target:
    base_url: str  # ending in /v1
    endpoint: str  # "completions" or "chat"
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def body(target: Target, conversation: Conversation, turn: int) -> dict[str, Any]:
    """The request for `turn` of `conversation`: earlier turns and their answers included."""
    current = conversation.turns[turn]
    out: dict[str, Any] = {
        "model": target.model,
        "max_tokens": current.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        messages = (
            [{"role": "system", "content": conversation.system}] if conversation.system else []
        )
        for t, answer in zip(conversation.turns[:turn], conversation.answers, strict=False):
            messages += [
                {"role": "user", "content": t.user},
                {"role": "assistant", "content": answer},
            ]
        messages += [{"role": "user", "content": d} for d in current.documents]
        out["messages"] = [*messages, {"role": "user", "content": user_content(current)}]
    else:
        history = "".join(
            t.user + answer
            for t, answer in zip(conversation.turns[:turn], conversation.answers, strict=False)
        )
        documents = "".join(d + SEPARATOR for d in current.documents)
        out["prompt"] = (conversation.system or "") + history + documents + current.user
        if current.documents:
            out["chunk_separator"] = SEPARATOR
    if target.ignore_eos:
        out["ignore_eos"] = True
    return out | (target.extra_body or {})


def user_content(turn: Turn) -> str | list[dict[str, Any]]:
    """A turn's text, or with images its parts: the images first, then the text."""
    if not turn.images:
        return turn.user
    images = [{"type": "image_url", "image_url": {"url": url}} for url in turn.images]
    return [*images, {"type": "text", "text": turn.user}]


def count_input(tokenizer: Tokenizer, request: dict[str, Any]) -> int:
    if "prompt" in request:
        return len(tokenizer.encode(request["prompt"], False))
    if any(not isinstance(m["content"], str) for m in request["messages"]):
        return 0  # images: only the server knows their tokens (its usage says)
    encode_chat = getattr(tokenizer, "encode_chat", None)
    if encode_chat is not None:
        return len(encode_chat(request["messages"]))
    return sum(len(tokenizer.encode(m["content"], False)) for m in request["messages"])


async def send(
    http: httpx.AsyncClient,
    target: Target,
    conversation: Conversation,
    turn: int,
    tokenizer: Tokenizer,
    clock: float,
    now: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send one turn; the record's times are seconds since `clock` (a value of `now`)."""
    request = body(target, conversation, turn)
    record = RequestRecord(start=now() - clock, input_tokens=0, turn=turn)
    usage: dict[str, Any] | None = None
    text: list[str] = []
    try:
        async with http.stream("POST", target.url, json=request, headers=target.headers) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")
                record.error = f"HTTP {r.status_code}: {_message(detail)}"
            else:
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        record.error = f"error event: {_message(json.dumps(event))}"
                        break
                    usage = event.get("usage") or usage
                    piece = _text(event)
                    if piece:
                        record.chunk_times.append(now() - clock)
                        text.append(piece)
                if not done and record.error is None:
                    record.error = "stream ended before [DONE]"
    except httpx.TimeoutException as e:
        record.error = f"timeout: {type(e).__name__}"
    except (httpx.TransportError, httpx.StreamError) as e:
        record.error = f"connection dropped: {type(e).__name__}"
    except json.JSONDecodeError:
        record.error = "malformed event"
    record.end = now() - clock
    record.output_text = "".join(text)
    if usage is not None:
        record.usage_reported = True
        record.input_tokens = int(usage.get("prompt_tokens", 0))
        record.output_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = int(details.get("cached_tokens", 0))
        record.approximate_tokens = int(details.get("approximate_tokens", 0))
    else:
        record.input_tokens = count_input(tokenizer, request)
        record.output_tokens = len(tokenizer.encode(record.output_text, False))
    return record


def _text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


def _message(detail: str) -> str:
    try:
        error = json.loads(detail).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (json.JSONDecodeError, AttributeError):
        message = detail
    return str(message).strip()[:200]
