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
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # tokens 1.. (scoring)


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
        return self(
            [{"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}]
        )


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def usage(
    prompt_tokens: int, completion_tokens: int, cached: int, reuse: Reuse | None = None
) -> dict[str, Any]:
    """OpenAI's usage; where approximate KV reuse placed some of the prompt (`reuse`), its
    details also say how much (`approximate_tokens`) and how much of that was computed again
    (`recomputed_tokens`): such an answer may differ from full computation's."""
    details: dict[str, Any] = {"cached_tokens": cached}
    if reuse is not None and reuse.approximate:
        details |= {"approximate_tokens": reuse.approximate, "recomputed_tokens": reuse.recomputed}
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


@dataclass
class Reuse:
    """A response's prompt tokens placed by approximate KV reuse, summed over its prompts."""

    approximate: int = 0
    recomputed: int = 0

    def add(self, approximate: int, recomputed: int) -> None:
        self.approximate += approximate
        self.recomputed += recomputed


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


class PromptScores:
    """The prompts' logprobs (scoring: `echo` with `logprobs`, vLLM's `prompt_logprobs`),
    taken from each prompt's first choice, which computed them."""

    def __init__(self, tokenizer: Tokenizer, prompts: Sequence[list[int]], top: int) -> None:
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.top = top  # top_logprobs entries per echoed token (the request's logprobs)
        self.entries: dict[int, list[pb.TokenLogprobs]] = {}

    def collect(self, prompt: int, choice: ChoiceState) -> None:
        if choice.prompt_logprobs and prompt not in self.entries:
            self.entries[prompt] = list(choice.prompt_logprobs)

    def _entries(self, prompt: int) -> list[pb.TokenLogprobs | None]:
        """One per prompt token: None for the first (nothing precedes it)."""
        found = self.entries.get(prompt, [])
        return [None, *found] + [None] * (len(self.prompts[prompt]) - 1 - len(found))

    def prepend(self, prompt: int, logprobs: dict[str, Any]) -> dict[str, Any]:
        """The completions logprobs of an echoed answer: the prompt's tokens, then the rest."""
        ids = self.prompts[prompt]
        texts = [token_text(self.tokenizer, t) for t in ids]
        offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        entries = self._entries(prompt)
        top: list[dict[str, float] | None] = []
        for e in entries:
            if e is None:
                top.append(None)
                continue
            pairs = list(zip(e.top_token_ids, e.top_logprobs, strict=True))[: self.top]
            pairs = pairs or [(e.token_id, e.logprob)]  # logprobs: 0, the token itself
            top.append({token_text(self.tokenizer, t): lp for t, lp in pairs})
        return {
            "tokens": texts + logprobs["tokens"],
            "token_logprobs": [e.logprob if e else None for e in entries]
            + logprobs["token_logprobs"],
            "top_logprobs": top + logprobs["top_logprobs"],
            "text_offset": offsets + logprobs["text_offset"],
        }

    def _logprob(self, token: int, logprob: float, rank: int) -> dict[str, Any]:
        return {
            "logprob": logprob,
            "rank": rank,
            "decoded_token": token_text(self.tokenizer, token),
        }

    def vllm(self, prompt: int, top: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None or {token id: its logprob, rank and
        text} for the token itself and the `top` most likely."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for e in self._entries(prompt):
            if e is None:
                out.append(None)
                continue
            ranked = list(zip(e.top_token_ids, e.top_logprobs, strict=True))[:top]
            scores = {str(t): self._logprob(t, lp, r) for r, (t, lp) in enumerate(ranked, 1)}
            scores[str(e.token_id)] = self._logprob(e.token_id, e.logprob, e.rank)
            out.append(scores)
        return out


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
