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

Proposers:
- `ngram` (prompt lookup): the latest earlier occurrence of the sequence's last n tokens
  (n = max_n down to min_n) in its own prompt and output; propose what followed it.
- `suffix`: the same, and a bounded index of this engine's recent outputs (agent loops and
  repeated tasks speculate from earlier answers); the longer match wins.
- `draft`: a smaller model with the same tokenizer drafts the tokens, each drawn from its own
  distribution q. For a sampled request the target then keeps a drafted token with
  probability min(1, p/q) and replaces the first it refuses by a draw from max(0, p - q)
  (standard rejection sampling: the tokens follow the target's distribution exactly, though
  they are not the tokens of a run without speculation); greedy requests keep the rule above.

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

import torch

from services.engine.block_manager import BlockManager, NoFreeBlocks
from services.engine.request import Sequence
from services.engine.sampler import distributions, draw, uniforms
from services.engine.seeds import choice_seed
from services.model.batch import ForwardBatch, SeqChunk
from services.model.llama import LlamaModel

METHODS = ("ngram", "suffix", "draft")
PAUSE = 4  # steps without proposals after a lone proposed token was refused
# independent uniform streams of a sequence's seed (choice_seed mixes these in)
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = (1 << 40) + 1, (1 << 40) + 2, (1 << 40) + 3


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # one of METHODS (`draft`: the Engine is given the draft model)
    num_tokens: int = 4  # tokens proposed per step, at most (k)
    max_batch: int = 4  # running sequences above which nothing is proposed
    min_n: int = 2  # shortest n-gram matched
    max_n: int = 4  # longest n-gram matched (the longest match is tried first)
    index_tokens: int = 1 << 16  # suffix: tokens of recent outputs kept in the index
    draft_model: str | None = None  # draft: where the worker loads the draft model from

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


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    # the distribution each token was drawn from, [len(tokens), vocab] float64; None: one-hot
    # guesses (verified by equality with the target's draw)
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Guesses what follows sequences. Contract: `propose` reads the sequences and changes
    nothing of them; `finished` is told of every sequence that ends (it may keep its tokens,
    and must free what it holds for it)."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to ks[i] tokens that may follow seqs[i].token_ids (fewer or none when it has no
        guess)."""
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

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(s, k)[1]) for s, k in zip(seqs, ks, strict=True)]

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

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._one(s, k) for s, k in zip(seqs, ks, strict=True)]

    def _one(self, seq: Sequence, k: int) -> Proposal:
        n, own = self.lookup(seq, k)
        m, recent = self.index.match(seq.token_ids, k)
        return Proposal(recent if m > n else own)

    def finished(self, seq: Sequence) -> None:
        super().finished(seq)
        if seq.num_output_tokens:
            lead = self.config.max_n - 1  # prompt tokens an output's first n-grams start in
            self.index.add(seq.token_ids[max(0, seq.prompt_len - lead) :])


class DraftModel:
    """The `draft` proposer: a smaller model sharing the target's tokenizer drafts k tokens,
    one forward pass each, on its own KV pool: each sequence has its own block table here,
    kept across steps, rolled back to what the target kept, freed when the sequence ends."""

    def __init__(self, model: LlamaModel, vocab_size: int, num_blocks: int, block_size: int):
        if model.config.vocab_size < vocab_size:
            raise ValueError("the draft model's vocabulary is smaller than the target's")
        self.model, self.vocab_size = model, vocab_size
        self.kv = model.new_kv_cache(num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, "draft", enable_caching=False)
        self.states: dict[tuple[str, int], Sequence] = {}  # (request, choice) -> its draft

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Draft step j runs one forward pass over every sequence still drafting: the tokens
        the draft has not computed yet (the target's new ones), or its last draft."""
        states = [self._state(s) for s in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(ks, default=0)):
            rows = [i for i, k in enumerate(ks) if j < k and len(tokens[i]) == j]
            rows = [i for i in rows if self._reserve(states[i])]
            if not rows:
                break
            chunks = [
                SeqChunk(states[i].token_ids[states[i].num_computed_tokens :],
                         states[i].num_computed_tokens, states[i].block_ids)
                for i in rows
            ]  # fmt: skip
            batch = ForwardBatch.build(chunks, self.blocks.block_size, self.model.device)
            logits = self.model.forward(batch, self.kv)[:, : self.vocab_size]  # [rows, V]
            for r, i in enumerate(rows):
                seq, state = seqs[i], states[i]
                state.num_computed_tokens = state.num_tokens
                if seq.params.greedy:
                    token = int(logits[r].argmax())
                else:
                    q = distributions(logits[r : r + 1], [seq.params])
                    u = uniforms([choice_seed(seq.seed, DRAFT_STREAM)], [seq.num_tokens + j])
                    token = int(draw(q, u)[0])
                    probs[i].append(q[0])
                tokens[i].append(token)
                state.token_ids.append(token)
        return [
            Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)
        ]

    def _reserve(self, state: Sequence) -> bool:
        """Blocks for the state's uncomputed tokens; False (nothing changed) if none free."""
        try:
            self.blocks.allocate(state, state.num_uncomputed)
        except NoFreeBlocks:
            return False
        return True

    def _state(self, seq: Sequence) -> Sequence:
        """seq's draft: its KV rolled back to the tokens it shares with seq now."""
        key = (seq.request_id, seq.index)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = Sequence(
                seq.request_id, seq.index, seq.prompt_len, [], seq.params, seq.seed, 0
            )
        common = 0
        for a, b in zip(state.token_ids, seq.token_ids, strict=False):
            if a != b:
                break
            common += 1
        state.token_ids = list(seq.token_ids)
        state.num_computed_tokens = min(state.num_computed_tokens, common)
        self.blocks.truncate(state)
        return state

    def finished(self, seq: Sequence) -> None:
        state = self.states.pop((seq.request_id, seq.index), None)
        if state is not None:
            self.blocks.release(state)


def make_proposer(config: SpeculativeConfig, draft: DraftModel | None = None) -> Proposer:
    if config.method == "draft":
        if draft is None:
            raise ValueError("speculative method 'draft' needs a draft model")
        return draft
    return SuffixLookup(config) if config.method == "suffix" else PromptLookup(config)


class Speculator:
    """Decides how many tokens each decoding sequence proposes, asks the proposer, and keeps
    the statistics and each sequence's adaptive length."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config, draft)
        self.stats = SpecStats()

    def lookahead(self, seq: Sequence, num_running: int) -> int:
        """How many tokens seq may propose: its adaptive length, no more than it may still
        produce after the next token; none past `max_batch` running sequences."""
        if num_running > self.config.max_batch:
            return 0
        if seq.spec_pause > 0:  # its proposals keep failing: rest a few steps
            seq.spec_pause -= 1
            return 0
        left = min(
            seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens
        )
        return min(seq.spec_length or self.config.num_tokens, left - 1)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[tuple[int, ...]]:
        out = []
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, limits), strict=True):
            draft, probs = proposal.tokens, proposal.probs
            if draft and seq.matcher is not None:  # the grammar would mask the rest: cut it
                draft = draft[: seq.matcher.validate_tokens(draft)]
            seq.draft_probs = probs[: len(draft)] if probs is not None and draft else None
            out.append(tuple(draft))
        return out

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Record a verification; the next length is one past the accepted run after a
        rejection, one more after a run accepted whole; a single token refused pauses the
        sequence's proposals for PAUSE steps (each costs a row and wins nothing)."""
        self.stats.steps += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        k = seq.spec_length or self.config.num_tokens
        grown = min(k + 1, self.config.num_tokens)
        seq.spec_length = grown if accepted == proposed else max(1, accepted + 1)
        if proposed == 1 and accepted == 0:
            seq.spec_pause = PAUSE

    def finished(self, seq: Sequence) -> None:
        self.proposer.finished(seq)


def keep_drawn(
    p: torch.Tensor, q: torch.Tensor, draft: Seq[int], seq: Sequence, bonus: int
) -> list[int]:
    """Rejection sampling of tokens drawn from q: the tokens the sequence gains. p: the
    target's distributions at the k + 1 rows [k + 1, V]; q: the draft's [k, V]; bonus: the
    target's own draw at row k (kept when every drafted token is)."""
    positions = [seq.num_tokens + j for j in range(len(draft))]
    accept = uniforms([choice_seed(seq.seed, ACCEPT_STREAM)] * len(draft), positions).tolist()
    for j, token in enumerate(draft):
        if accept[j] * float(q[j, token]) < float(p[j, token]):  # kept: probability min(1, p/q)
            continue
        residual = (p[j] - q[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing left, draw from p
            residual = p[j]
        u = uniforms([choice_seed(seq.seed, RESIDUAL_STREAM)], [positions[j]])
        return [*draft[:j], int(draw(residual[None], u)[0])]
    return [*draft, bonus]


def accepted_run(draft: Seq[int], targets: Seq[int]) -> int:
    """How many proposed tokens equal the target's tokens at their rows, from the first."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n
