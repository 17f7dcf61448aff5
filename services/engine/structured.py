"""Structured output: a grammar per constrained sequence, its token mask applied in the sampler.

The grammar engine is llguidance (docs/benchmarks.md, "Structured output": no dependencies
beyond itself, no compile step per schema, ~20 us per mask at batch 1 here). A request's
grammar arrives as llguidance's grammar text, made at the router from the user's JSON schema,
regex, choices or Lark grammar (router/completions/structured.py); the engine keeps one matcher per
sequence, advanced over every token the sequence has: a sequence that arrives with output
already generated (the prefill -> decode handoff, a migration after a decode worker died)
starts from a matcher advanced over that output, and a preempted sequence keeps its matcher
(recomputing KV does not change its tokens).
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import cached_property

import llguidance
import torch

from services.engine.grammar_text import check_grammar
from services.engine.params import ValidationError
from services.model import kernels
from services.model.batch import on_device
from services.tokenizer.tokenizer import Tokenizer

Matcher = llguidance.LLMatcher


@dataclass
class MaskTimes:
    """What the masks cost (bench/structured.py reports it per step)."""

    steps: int = 0  # steps that masked at least one row
    rows: int = 0
    seconds: float = 0.0  # computing the masks and applying them to the logits


class Grammars:
    """Matchers for one engine's vocabulary; the tokenizer is converted on first use (~0.4 s)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Seq[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.executor = llguidance.LLExecutor()
        self.times = MaskTimes()

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

    def mask(
        self,
        x: torch.Tensor,
        rows: Seq[int],
        matchers: Seq[Matcher],
        drafts: Seq[Seq[int]] | None = None,
    ) -> None:
        """Set x[rows[i], t] to -inf for every token t matchers[i] does not allow, in place;
        with drafts[i] (speculative decoding), also x[rows[i] + j + 1] for the state after
        drafts[i][: j + 1] (the matcher is left as it was). x: [R, vocab] float32."""
        start = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        drafts = drafts or [()] * len(rows)
        firsts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        bits = torch.full((firsts[-1], words), -1, dtype=torch.int32)  # -1: all allowed
        items = list(zip(matchers, firsts, drafts, strict=False))
        if plain := [(m, k) for m, k, d in items if not d]:
            self.executor.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, firsts[-1])
        if drafted := [(m, k, list(d)) for m, k, d in items if d]:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, bits.data_ptr(), words * 4, firsts[-1]
            )
        masked = [r + j for r, d in zip(rows, drafts, strict=True) for j in range(len(d) + 1)]
        apply_mask(x, torch.tensor(masked, dtype=torch.int64), bits, self.vocab_size)
        self.times.steps += 1
        self.times.rows += len(masked)
        self.times.seconds += time.perf_counter() - start

    @staticmethod
    def advance(m: Matcher, token: int) -> bool:
        """Consume a sampled token; False when the grammar refused it (the mask allowed it,
        so only a token forced past the mask, e.g. by ignore_eos, can be refused)."""
        return bool(m.consume_token(token))


def apply_mask(
    x: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor, vocab: int, use_kernel: bool = True
) -> None:
    """x[rows[i], t] = -inf where bits[i] clears token t, and past `vocab` (padded embedding
    rows no token maps to). x: [R, V >= vocab] float32; bits: [len(rows), words] int32."""
    if x.shape[1] > vocab:
        x[on_device(rows, x.device), vocab:] = -float("inf")
    on_cpu = x.device.type == "cpu"
    library = kernels.load("token_mask") if use_kernel and on_cpu else None
    if library is None or x.dtype != torch.float32 or x.stride(1) != 1:
        rows, bits = on_device(rows, x.device), on_device(bits, x.device)  # made on the host
        x[rows, :vocab] = x[rows, :vocab].masked_fill(unpack(bits, vocab) == 0, -float("inf"))
        return
    library.apply_token_mask(
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(x.stride(0)),
        ctypes.c_void_p(rows.data_ptr()),
        ctypes.c_int64(len(rows)),
        ctypes.c_void_p(bits.contiguous().data_ptr()),
        ctypes.c_int64(bits.shape[1]),
        ctypes.c_int64(vocab),
    )


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, words] int32 bitmasks as [R, vocab] 0/1 (the reference for kernels/token_mask.c)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).reshape(bits.shape[0], -1)[:, :vocab]
