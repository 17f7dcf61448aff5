"""Grammar text checked without a tokenizer or torch: the router validates requests with it
before any worker sees them, and the engine again before it builds a matcher."""

from __future__ import annotations

import llguidance


def check_grammar(grammar: str) -> str:
    """The grammar text's error, '' when llguidance accepts it."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else ""
