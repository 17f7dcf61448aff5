"""Sampling parameters, validated once at the edge; the engine trusts them afterwards."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

# The bounds of the sampling fields, here once: the router's request bodies check the same.
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default
MAX_LOGPROBS = 20  # top alternatives per token, at most
PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
LOGIT_BIAS_LIMIT = 100.0  # a logit bias lies in [-100, 100] (OpenAI)


class ValidationError(ValueError):
    """A request the engine refuses; `field` names the offending parameter."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        self.message = message
        super().__init__(f"{field_name}: {message}")


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how. Defaults follow the OpenAI API (and vLLM) where they differ."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 (or 0) = all tokens
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the top one's
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL-style: divides (or multiplies) prompt+output logits
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # EOS and stop tokens are masked until this many are generated
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings, matched across token boundaries
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    n: int = 1
    seed: int | None = None  # None: the engine draws one
    logprobs: int | None = None  # log-probabilities of the sampled token plus this many top ones
    # log-probabilities of the prompt's tokens (each after the first) plus this many top ones;
    # the prompt is then computed whole, not taken from a cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # structured output: llguidance's grammar text (services/engine/structured.py), made at
    # the edge from a JSON schema, regex, choices or Lark grammar; None: unconstrained
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int) -> SamplingParams:
        """Self, or a ValidationError naming the first bad field."""
        _check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(
            _is_int(self.top_k) and -1 <= self.top_k <= vocab_size,
            "top_k",
            f"must be -1 or 0 (off), or 1..{vocab_size} (the vocabulary)",
        )
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _finite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT,
                name,
                f"must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]",
            )
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        if self.logprobs is not None:
            _check(
                _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            )
        if self.prompt_logprobs is not None:
            _check(
                _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            )
        if self.grammar is not None:
            _check(isinstance(self.grammar, str) and self.grammar != "", "grammar", "empty")
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", "must be an integer")
        for token, bias in self.logit_bias.items():
            _check(
                _is_int(token) and 0 <= token < vocab_size,
                "logit_bias",
                f"token id {token} is outside the vocabulary",
            )
            _check(
                _finite(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT,
                "logit_bias",
                f"biases must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
            )
        for token in self.stop_token_ids:
            _check(
                _is_int(token) and 0 <= token < vocab_size,
                "stop_token_ids",
                f"token id {token} is outside the vocabulary",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        return self

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SamplingParams:
        """Build from loose input (JSON, CLI); unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValidationError(unknown[0], "unknown parameter")
        values = dict(raw)
        for key in ("stop", "stop_token_ids"):
            if key in values and isinstance(values[key], (list, tuple)):
                values[key] = tuple(values[key])
            elif key == "stop" and isinstance(values.get(key), str):
                values[key] = (values[key],)
        return cls(**values)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValidationError(name, message)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_prompt(
    prompt: Sequence[int], vocab_size: int, max_model_len: int, max_tokens: int
) -> None:
    """A prompt the model can take: non-empty, in the vocabulary, within the context window."""
    _check(len(prompt) > 0, "prompt", "must not be empty")
    bad = next((t for t in prompt if not (_is_int(t) and 0 <= t < vocab_size)), None)
    _check(bad is None, "prompt", f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    _check(
        len(prompt) < max_model_len,
        "prompt",
        f"prompt has {len(prompt)} tokens; the context window is {max_model_len}",
    )
    _check(
        len(prompt) + max_tokens <= max_model_len,
        "max_tokens",
        f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the context "
        f"window of {max_model_len} tokens",
    )
