"""Structured output: a grammar per constrained sequence, its token mask applied in the sampler.

The grammar engine is llguidance (docs/benchmarks.md, "Structured output": no dependencies
beyond itself, no compile step per schema, ~20 us per mask at batch 1 here). A request's
grammar arrives as llguidance's grammar text, made at the router from the user's JSON schema,
regex, choices or Lark grammar (router/structured.py); the engine keeps one matcher per
sequence, advanced over every token the sequence has: a sequence that arrives with output
already generated (the prefill -> decode handoff, a migration after a decode worker died)
starts from a matcher advanced over that output, and a preempted sequence keeps its matcher
(recomputing KV does not change its tokens).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from functools import cached_property

import llguidance
import torch

from services.engine.params import ValidationError
from services.tokenizer.tokenizer import Tokenizer

Matcher = llguidance.LLMatcher


def check_grammar(grammar: str) -> str:
    """The grammar text's error, '' when llguidance accepts it (no tokenizer needed)."""
    is_error, messages = Matcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else ""


class Grammars:
    """Matchers for one engine's vocabulary; the tokenizer is converted on first use (~0.4 s)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Seq[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.executor = llguidance.LLExecutor()

    @cached_property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(
            self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
        )

    def matcher(self, grammar: str, output_ids: Seq[int]) -> Matcher:
        """A matcher advanced over the tokens already generated, or a ValidationError."""
        error = check_grammar(grammar)
        if error:
            raise ValidationError("grammar", error)
        m = Matcher(self.lltokenizer, grammar, log_level=0)
        if output_ids and not m.consume_tokens(list(output_ids)):
            why = m.get_error()
            raise ValidationError("output_token_ids", f"not allowed by the grammar: {why}")
        return m

    def mask(self, x: torch.Tensor, rows: Seq[int], matchers: Seq[Matcher]) -> None:
        """Set x[rows[i], t] to -inf for every token t matchers[i] does not allow, in place.
        x: [R, vocab] float32."""
        words = (self.vocab_size + 31) // 32
        bits = torch.full((len(rows), words), -1, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(rows)
        )
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bits[:, :, None] >> shifts) & 1).reshape(len(rows), words * 32)
        index = torch.tensor(list(rows))
        x[index, : self.vocab_size] = x[index, : self.vocab_size].masked_fill(
            allowed[:, : self.vocab_size] == 0, -float("inf")
        )
        if x.shape[1] > self.vocab_size:  # padded embedding rows no tokenizer token maps to
            x[index, self.vocab_size :] = -float("inf")

    @staticmethod
    def advance(m: Matcher, token: int) -> bool:
        """Consume a sampled token; False when the grammar refused it (the mask allowed it,
        so only a token forced past the mask, e.g. by ignore_eos, can be refused)."""
        return bool(m.consume_token(token))
