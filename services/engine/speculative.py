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

Proposers (services/engine/proposers.py): `ngram` (prompt lookup), `suffix` (also over recent
outputs), `draft` (a smaller model), `mtp` (the checkpoint's own MTP layer, mtp_proposer.py).
A draft model's (or MTP layer's) tokens are drawn from its distribution q: for a sampled
request the target keeps a drafted token with probability min(1, p/q) and replaces the
first it refuses by a draw from max(0, p - q) (standard rejection sampling: the tokens
follow the target's distribution exactly, though they are not the tokens of a run without
speculation); greedy requests keep the rule above.

Adaptive: a sequence proposes up to its own length k, which shrinks to one past the accepted
run after a rejection and grows by one after a run accepted whole; nothing is proposed while
more than `max_batch` sequences run (verifying then costs more than it saves: a setting,
measured in docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import cast

import torch

from services.engine.mtp_proposer import MtpProposer
from services.engine.proposers import DraftModel, PromptLookup, Proposer, SuffixLookup
from services.engine.request import Sequence, TokenLogprobs
from services.engine.sampler import Sampler, draw, score_tokens, uniforms
from services.engine.scheduler import ScheduledChunk
from services.engine.seeds import choice_seed
from services.model.causal_lm import CausalLM, MtpLayer
from services.settings import SpeculativeConfig

PAUSE = 4  # steps without proposals after a lone proposed token was refused
# uniform streams of a sequence's seed independent of its draws' (choice_seed mixes these in;
# the draft model's is proposers.DRAFT_STREAM)
ACCEPT_STREAM, RESIDUAL_STREAM = (1 << 40) + 2, (1 << 40) + 3


@dataclass
class SpecStats:
    """What speculation did (the worker's Prometheus counters)."""

    steps: int = 0  # sequence-steps that verified at least one proposed token
    proposed: int = 0
    accepted: int = 0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


def draft_proposer(
    config: SpeculativeConfig,
    draft: CausalLM | MtpLayer | None,
    target: CausalLM,
    num_blocks: int,
    block_size: int,
) -> Proposer | None:
    """The proposer around a draft model (`draft`) or an MTP layer (`mtp`: the target then
    keeps its hidden rows), with a pool of its own as large as the target's."""
    vocab_size = target.config.vocab_size
    if draft is None:
        return None
    if config.method == "mtp":
        if not target.capabilities.hidden_rows:
            raise ValueError("--speculative mtp: the model keeps no hidden rows to draft from")
        target.keep_hidden = True
        return MtpProposer(cast(MtpLayer, draft), vocab_size, num_blocks, block_size)
    return DraftModel(cast(CausalLM, draft), vocab_size, num_blocks, block_size)


def make_proposer(config: SpeculativeConfig, draft: Proposer | None = None) -> Proposer:
    if config.method in ("draft", "mtp"):
        if draft is None:
            raise ValueError(f"speculative method {config.method!r} needs its draft model")
        return draft
    if config.method == "suffix":
        return SuffixLookup(config.min_n, config.max_n, config.index_tokens)
    return PromptLookup(config.min_n, config.max_n)


class Speculator:
    """Decides how many tokens each decoding sequence proposes, asks the proposer, and keeps
    the statistics and each sequence's adaptive length."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: Proposer | None = None
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

    def keep(
        self,
        seq: Sequence,
        draft: Seq[int],
        logits: torch.Tensor,
        targets: list[int],
        logprobs: list[TokenLogprobs | None],
        sampler: Sampler,
    ) -> list[int]:
        """The tokens seq gains from verifying `draft`: the proposals kept, then one more.
        logits: the draft's rows [k + 1, vocab]; targets, logprobs: the target's draws at
        them (logprobs corrected in place where rejection sampling draws another token)."""
        probs, seq.draft_probs = seq.draft_probs, None
        if probs is None or seq.params.greedy:  # one-hot: kept while equal to the target's
            kept = targets[: accepted_run(draft, targets) + 1]
        else:  # drawn from the draft's q: rejection sampling
            ahead = [draft[:j] for j in range(len(draft) + 1)]
            p = sampler.distributions(logits, [seq] * len(ahead), ahead)
            kept = keep_drawn(p, probs, draft, seq, targets[len(draft)])
            last = len(kept) - 1
            if kept[last] != targets[last] and seq.params.logprobs is not None:
                scored = score_tokens(logits[last : last + 1], kept[last:], seq.params.logprobs)
                logprobs[last] = replace(scored[0], rank=0)
        self.verified(seq, len(draft), len(kept) - 1)
        return kept

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

    def observe(self, chunks: list[ScheduledChunk], model: object) -> None:
        """After a target pass: a proposer that drafts from the target's hidden states (MTP)
        takes each chunk's rows."""
        if isinstance(self.proposer, MtpProposer):
            self.proposer.observe(chunks, getattr(model, "hidden", None))


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
        u = uniforms([choice_seed(seq.seed, RESIDUAL_STREAM)], [positions[j]], p.device)
        return [*draft[:j], int(draw(residual[None], u)[0])]
    return [*draft, bonus]


def accepted_run(draft: Seq[int], targets: Seq[int]) -> int:
    """How many proposed tokens equal the target's tokens at their rows, from the first."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n
