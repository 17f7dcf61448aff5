"""Incremental detokenization: text for each new token, never half a UTF-8 character.

Byte-level BPE tokens can end inside a multi-byte character, and some tokenizers change how a
token reads depending on its left neighbour. So each step decodes a short window of recent
tokens twice, with and without the new ones, and emits the difference once it no longer ends
in the replacement character that a partial character decodes to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context for the first generated tokens.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed token ids one step at a time; `add` returns the text they complete.

    `decode` turns a list of ids into text (special tokens already skipped or kept as the
    caller wants). Text already emitted is never taken back.
    """

    def __init__(
        self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int] = ()
    ) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this have been emitted
        self.text = ""

    def add(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if full_text.endswith(REPLACEMENT) or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character, or nothing visible yet
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is left, replacement characters included."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        delta = full_text[len(prefix_text) :]
        self._read = len(self._ids)
        self.text += delta
        return delta
