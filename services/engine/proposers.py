"""Speculative decoding's proposers: what may follow a decoding sequence
(services/engine/speculative.py verifies it).

- `PromptLookup` (`ngram`): the latest earlier occurrence of the sequence's last n tokens
  (n = max_n down to min_n) in its own prompt and output; propose what followed it.
- `SuffixLookup` (`suffix`): the same, and a bounded index of this engine's recent outputs
  (agent loops and repeated tasks speculate from earlier answers); the longer match wins.
- `DraftModel` (`draft`): a smaller model with the same tokenizer drafts the tokens, each
  drawn from its own distribution q (returned with them, for rejection sampling).
- `MtpProposer` (`mtp`, mtp_proposer.py): the checkpoint's own multi-token-prediction layer,
  from the target's hidden states; drawn the same way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.engine.block_manager import BlockManager, NoFreeBlocks
from services.engine.request import Sequence
from services.engine.sampler import distributions, draw, sample_rows, uniforms
from services.engine.seeds import choice_seed
from services.model.batch import ForwardBatch, SeqChunk
from services.model.causal_lm import CausalLM

DRAFT_STREAM = (1 << 40) + 1  # the draft's draws: a uniform stream of its own (choice_seed)


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
    """The `ngram` proposer: the sequence's own prompt and output, indexed as they grow;
    n-grams of min_n..max_n tokens, the longest match first."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(s, k)[1]) for s, k in zip(seqs, ks, strict=True)]

    def lookup(self, seq: Sequence, k: int) -> tuple[int, list[int]]:
        """(n, tokens): the match's length and what followed it."""
        index = seq.spec_index
        if index is None:
            index = seq.spec_index = NgramIndex(self.min_n, self.max_n)
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

    def __init__(self, min_n: int, max_n: int, index_tokens: int) -> None:
        super().__init__(min_n, max_n)
        self.index = OutputIndex(min_n, max_n, index_tokens)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._one(s, k) for s, k in zip(seqs, ks, strict=True)]

    def _one(self, seq: Sequence, k: int) -> Proposal:
        n, own = self.lookup(seq, k)
        m, recent = self.index.match(seq.token_ids, k)
        return Proposal(recent if m > n else own)

    def finished(self, seq: Sequence) -> None:
        super().finished(seq)
        if seq.num_output_tokens:
            lead = self.max_n - 1  # prompt tokens an output's first n-grams start in
            self.index.add(seq.token_ids[max(0, seq.prompt_len - lead) :])


def draft_token(
    logits: torch.Tensor, seq: Sequence, j: int, coupled: bool = False
) -> tuple[int, torch.Tensor | None]:
    """A drafter's j-th token for seq from its logits [vocab]: the argmax for a greedy request
    (one-hot), else a draw from its distribution q (returned) on a uniform stream of its own.
    `coupled`, for a request with its own seed: drawn with the uniform the target will draw
    that position with (one-hot: kept only where the target's own draw is the same token, so
    the answer is the one without speculation; the closer q is to the target's, the likelier)."""
    if seq.params.greedy:
        return int(logits.argmax()), None
    if coupled and seq.params.seed is not None:
        u = uniforms([seq.seed], [seq.num_tokens + j])
        return int(sample_rows(logits[None].double(), [seq.params], u)[0]), None
    q = distributions(logits[None], [seq.params])
    u = uniforms([choice_seed(seq.seed, DRAFT_STREAM)], [seq.num_tokens + j])
    return int(draw(q, u)[0]), q[0]


class DraftModel:
    """The `draft` proposer: a smaller model sharing the target's tokenizer drafts k tokens,
    one forward pass each, on its own KV pool: each sequence has its own block table here,
    kept across steps, rolled back to what the target kept, freed when the sequence ends."""

    def __init__(self, model: CausalLM, vocab_size: int, num_blocks: int, block_size: int):
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
                SeqChunk(
                    states[i].token_ids[states[i].num_computed_tokens :],
                    states[i].num_computed_tokens,
                    states[i].block_ids,
                )
                for i in rows
            ]
            batch = ForwardBatch.build(chunks, self.blocks.block_size, self.model.device)
            logits = self.model.forward(batch, self.kv)[:, : self.vocab_size]  # [rows, V]
            for r, i in enumerate(rows):
                seq, state = seqs[i], states[i]
                state.num_computed_tokens = state.num_tokens
                token, q = draft_token(logits[r], seq, j)
                if q is not None:
                    probs[i].append(q)
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
