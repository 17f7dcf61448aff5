"""Speculative decoding: a proposer guesses the next tokens of a decoding sequence and one
forward pass computes them all; the engine keeps those the target model would have drawn.

    token_ids:  | prompt ...... output ... t |           t: the last sampled token
    chunk:                                 | t d0 d1 d2 |  proposed d0..d2, computed with t
    logits row:                              0  1  2  3    row j: the next token after d[:j]

Row j is sampled exactly as the token would be without speculation (the same processed logits,
the same (seed, position) uniform: services/engine/sampler.py). A proposed token is accepted
while it equals the target's token at its row; the first row that differs gives the target's
own token, and a run accepted whole gives one more (row k). With one-hot proposals (n-gram,
suffix) every token kept is the token the sequence would have drawn anyway: greedy and seeded
requests give the same tokens with speculation on or off, alone or in any batch.

Rejected tokens' KV is rolled back by the engine: the sequence's computed length stops after
its last accepted token and its blocks past that go back to the pool (BlockManager.truncate).

Proposers (no extra model):
- `ngram` (prompt lookup): the latest earlier occurrence of the sequence's last n tokens
  (n = max_n down to min_n) in its own prompt and output; propose what followed it.
- `suffix`: the same, and a bounded index of this engine's recent outputs (agent loops and
  repeated tasks speculate from earlier answers); the longer match wins.

Adaptive: a sequence proposes up to its own length k, which shrinks to one past the accepted
run after a rejection and grows by one after a run accepted whole; nothing is proposed while
more than `max_batch` sequences run (verifying then costs more than it saves: a setting,
measured in docs/benchmarks.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from services.engine.request import Sequence

METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # one of METHODS
    num_tokens: int = 4  # tokens proposed per step, at most (k)
    max_batch: int = 4  # running sequences above which nothing is proposed
    min_n: int = 2  # shortest n-gram matched
    max_n: int = 4  # longest n-gram matched (the longest match is tried first)
    index_tokens: int = 1 << 16  # suffix: tokens of recent outputs kept in the index

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: one of {', '.join(METHODS)}")
        if self.num_tokens < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError("num_tokens >= 1 and 1 <= min_n <= max_n")


@dataclass
class SpecStats:
    """What speculation did (the worker's Prometheus counters)."""

    steps: int = 0  # sequence-steps that verified at least one proposed token
    proposed: int = 0
    accepted: int = 0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


class Proposer(Protocol):
    """Guesses what follows a sequence. Contract: `propose` reads the sequence and changes
    nothing of it; `finished` is told of every sequence that ends (it may keep its tokens)."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens that may follow seq.token_ids (fewer or none when it has no guess)."""
        ...

    def finished(self, seq: Sequence) -> None: ...


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a growing token list last ended, so that
    what followed it can be proposed. Only n-grams with at least one token after them are
    indexed: the list's own tail never matches itself."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at or before this position are in `ends`

    def extend(self, tokens: Seq[int], end: int) -> None:
        """Index the n-grams of tokens ending after `indexed`, up to `end`."""
        for e in range(self.indexed + 1, end + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.ends[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end)

    def match(self, tail: Seq[int]) -> tuple[int, int]:
        """(n, end): the longest n-gram ending `tail` that is indexed, and where it ended;
        (0, 0) when none is."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            end = self.ends.get(tuple(tail[len(tail) - n :]))
            if end is not None:
                return n, end
        return 0, 0


class PromptLookup:
    """The `ngram` proposer: the sequence's own prompt and output, indexed as they grow."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.lookup(seq, k)[1]

    def lookup(self, seq: Sequence, k: int) -> tuple[int, list[int]]:
        """(n, tokens): the match's length and what followed it."""
        index = seq.spec_index
        if index is None:
            index = seq.spec_index = NgramIndex(self.config.min_n, self.config.max_n)
        tokens = seq.token_ids
        index.extend(tokens, len(tokens) - 1)
        n, end = index.match(tokens)
        return n, tokens[end : end + k] if n else []

    def finished(self, seq: Sequence) -> None:
        seq.spec_index = None


@dataclass
class _Output:
    id: int
    tokens: list[int]


@dataclass
class OutputIndex:
    """The n-grams of recent outputs (each with the end of its prompt, so that an answer's
    first tokens can be matched), bounded to `capacity` tokens: the oldest output goes
    first."""

    min_n: int
    max_n: int
    capacity: int
    ends: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # -> (id, end)
    outputs: deque[_Output] = field(default_factory=deque)
    by_id: dict[int, _Output] = field(default_factory=dict)
    size: int = 0
    next_id: int = 0

    def add(self, tokens: list[int]) -> None:
        if len(tokens) <= self.min_n:
            return
        out = _Output(self.next_id, tokens[-self.capacity :])
        self.next_id += 1
        self.outputs.append(out)
        self.by_id[out.id] = out
        self.size += len(out.tokens)
        for key, end in self._ngrams(out.tokens):
            self.ends[key] = (out.id, end)
        while self.size > self.capacity:
            self._evict()

    def _ngrams(self, tokens: list[int]) -> list[tuple[tuple[int, ...], int]]:
        return [
            (tuple(tokens[e - n : e]), e)
            for e in range(self.min_n, len(tokens))  # at least one token follows
            for n in range(self.min_n, min(self.max_n, e) + 1)
        ]

    def _evict(self) -> None:
        old = self.outputs.popleft()
        del self.by_id[old.id]
        self.size -= len(old.tokens)
        for key, _ in self._ngrams(old.tokens):
            if self.ends.get(key, (-1, 0))[0] == old.id:
                del self.ends[key]

    def match(self, tail: Seq[int], k: int) -> tuple[int, list[int]]:
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            hit = self.ends.get(tuple(tail[len(tail) - n :]))
            if hit is not None:
                out_id, end = hit
                return n, self.by_id[out_id].tokens[end : end + k]
        return 0, []


class SuffixLookup(PromptLookup):
    """The `suffix` proposer: the sequence's own tokens, and the outputs this engine finished
    recently; the longer match wins (the sequence's own on a tie)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.index = OutputIndex(config.min_n, config.max_n, config.index_tokens)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        n, own = self.lookup(seq, k)
        m, recent = self.index.match(seq.token_ids, k)
        return recent if m > n else own

    def finished(self, seq: Sequence) -> None:
        super().finished(seq)
        if seq.num_output_tokens:
            lead = self.config.max_n - 1  # prompt tokens an output's first n-grams start in
            self.index.add(seq.token_ids[max(0, seq.prompt_len - lead) :])


def make_proposer(config: SpeculativeConfig) -> Proposer:
    return SuffixLookup(config) if config.method == "suffix" else PromptLookup(config)


class Speculator:
    """Decides how many tokens each decoding sequence proposes, asks the proposer, and keeps
    the statistics and each sequence's adaptive length."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = make_proposer(config)
        self.stats = SpecStats()

    def propose(self, seq: Sequence, limit: int, num_running: int) -> tuple[int, ...]:
        """Tokens to verify after seq's last one: at most `limit` (what the sequence may still
        produce, the step's budget, the blocks free), none past `max_batch` sequences."""
        if num_running > self.config.max_batch or limit <= 0:
            return ()
        k = seq.spec_length or self.config.num_tokens
        draft = self.proposer.propose(seq, min(k, limit))
        if draft and seq.matcher is not None:  # the grammar would mask the rest: cut it
            draft = draft[: seq.matcher.validate_tokens(draft)]
        return tuple(draft)

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Record a verification; the next length is one past the accepted run after a
        rejection, one more after a run accepted whole."""
        self.stats.steps += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        k = seq.spec_length or self.config.num_tokens
        grown = min(k + 1, self.config.num_tokens)
        seq.spec_length = grown if accepted == proposed else max(1, accepted + 1)

    def finished(self, seq: Sequence) -> None:
        self.proposer.finished(seq)


def accepted_run(draft: Seq[int], targets: Seq[int]) -> int:
    """How many proposed tokens equal the target's tokens at their rows, from the first."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n
