"""The chunks a request marks for approximate KV reuse (services/engine/chunk_reuse.py): spans
of its prompt that may be found again elsewhere, each kept by a worker under its own tokens.

- chat: each message's text where the rendered template holds it (system prompts, documents
  pasted in a user turn, tool results, earlier answers);
- completions: the pieces of a text prompt between occurrences of the `chunk_separator` the
  caller names (none named: no chunks).

A chunk is the tokens lying wholly inside its characters (a token across its edge belongs to
neither side), so the same text tokenizes to the same chunk wherever it stands. Workers keep
only chunks of at least --kv-reuse-min-tokens, and only for requests that reuse
approximately; marking costs nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.completions.protocol import ChatMessage

Spans = list[tuple[int, int]]


def message_spans(text: str, messages: Sequence[ChatMessage]) -> Spans:
    """Where each message's text stands in the rendered chat, in order (a message the
    template changed, and an empty one, marks nothing)."""
    spans, at = [], 0
    for m in messages:
        content = m.text.strip()
        found = text.find(content, at) if content else -1
        if found >= 0:
            spans.append((found, found + len(content)))
            at = found + len(content)
    return spans


def separated(text: str, separator: str | None) -> Spans:
    """The pieces of `text` between occurrences of `separator` (none: no pieces)."""
    if not separator:
        return []
    spans, at = [], 0
    while True:
        found = text.find(separator, at)
        end = len(text) if found < 0 else found
        if end > at:
            spans.append((at, end))
        if found < 0:
            return spans
        at = found + len(separator)
