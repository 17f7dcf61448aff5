"""Responses in the OpenAI API's shapes: completions and chat, whole or as SSE chunks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.rpc import worker_pb2 as pb
from services.tokenizer.tokenizer import Tokenizer


@dataclass
class ChoiceState:
    """What a choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True)
class Envelope:
    """What every stream chunk of one request carries around its choices."""

    id: str
    object: str  # "text_completion" or "chat.completion.chunk"
    created: int
    model: str

    def __call__(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}  # fmt: skip

    def choice(
        self, index: int, finish_reason: str | None, logprobs: Any, **content: Any
    ) -> dict[str, Any]:
        """A chunk with one choice: its index, its content (`text`, or a chat `delta`), its
        logprobs and finish reason, in OpenAI's order."""
        return self([{"index": index, **content, "logprobs": logprobs,
                      "finish_reason": finish_reason}])  # fmt: skip


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, entries: Sequence[pb.TokenLogprobs], offset: int
) -> dict[str, Any]:
    """The legacy completions format: parallel lists, offsets into the choice's text."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {
                token_text(tokenizer, t): lp
                # logprobs: 0 shows the chosen token alone, as vLLM does
                for t, lp in list(zip(e.top_token_ids, e.top_logprobs, strict=True))
                or [(e.token_id, e.logprob)]
            }
            for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(
    tokenizer: Tokenizer, entries: Sequence[pb.TokenLogprobs], top: int
) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **item(e.token_id, e.logprob),
                "top_logprobs": [
                    item(t, lp)
                    for t, lp in list(zip(e.top_token_ids, e.top_logprobs, strict=True))[:top]
                ],
            }
            for e in entries
        ]
    }


def completion_body(
    envelope: Envelope,
    choices: Sequence[ChoiceState],
    tokenizer: Tokenizer,
    want_logprobs: bool,
    echo_texts: Sequence[str],
    usage_: dict[str, Any],
) -> dict[str, Any]:
    out = []
    for c in choices:
        echo = echo_texts[c.index] if echo_texts else ""
        out.append(
            {
                "index": c.index,
                "text": echo + c.text,
                "logprobs": completion_logprobs(tokenizer, c.logprobs, len(echo))
                if want_logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
        )
    return envelope(out, usage=usage_)  # the stream's object name, "text_completion"


def chat_body(
    envelope: Envelope,
    choices: Sequence[ChoiceState],
    tokenizer: Tokenizer,
    top_logprobs: int | None,
    usage_: dict[str, Any],
) -> dict[str, Any]:
    out = []
    for c in choices:
        out.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(tokenizer, c.logprobs, top_logprobs or 0)
                if top_logprobs is not None
                else None,
                "finish_reason": c.finish_reason,
            }
        )
    return {**envelope(out, usage=usage_), "object": "chat.completion"}  # not ".chunk"
