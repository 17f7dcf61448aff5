"""The `mtp` proposer: the checkpoint's own multi-token-prediction layer drafts (its family's
MTP module: services/model/families/deepseek/mtp.py, deepseek_v4/mtp.py), from the target's
hidden states.

MTP index i stands for target position origin + i: it mixes the target's hidden state there,
h[origin + i], with the token after it, t[origin + i + 1], and its logits guess the token after
that. So once the target has computed positions < m (and sampled t[m]), the layer catches up
on the indices it lacks up to position m - 1 in one pass, whose last row drafts d0 (= t[m + 1]'s
guess); each further pass feeds its own h' and the last draft token to draft one more. Those
chained entries are dropped at the next proposal, when the target's own hidden states for the
accepted positions have come (`observe`, after every target pass).

Where the target's states for a sequence's earlier positions were never computed here (a
prompt from the prefix cache or the store, a migrated stream) the layer starts at the first
position it has: `origin` moves there. Attention depends on positions only through their
differences (rotary), so the layer's own positions count from its origin. Draft tokens
(proposers.draft_token): a greedy request's argmax; a seeded request's drawn with the uniform
the target draws that position with, kept only where the target's draw is the same token
(greedy and seeded answers are those without speculation); other sampled requests' drawn
from the layer's q and verified by rejection sampling, as a draft model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.block_manager import BlockManager, NoFreeBlocks
from services.engine.proposers import Proposal, draft_token
from services.engine.request import Sequence
from services.engine.scheduler import ScheduledChunk
from services.model.batch import ForwardBatch, SeqChunk
from services.model.causal_lm import MtpLayer

# target hidden rows a sequence keeps for the layer, at most: a sequence that does not propose
# (more than speculative_max_batch running) keeps its latest, and the layer starts there
MAX_WAITING = 512


@dataclass
class _State:
    seq: Sequence  # the layer's own: token_ids[i] = t[origin + i + 1], blocks in its pool
    origin: int = 0
    exact: int = 0  # indices computed from the target's states (the rest are chained)
    waiting: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> h


class MtpProposer:
    def __init__(
        self,
        mtp: MtpLayer,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self.mtp, self.vocab_size, self.max_waiting = mtp, vocab_size, max_waiting
        self.kv = mtp.new_kv_cache(num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, "mtp", enable_caching=False)
        self.states: dict[tuple[str, int], _State] = {}

    def observe(self, chunks: list[ScheduledChunk], hidden: torch.Tensor | None) -> None:
        """The target's pass: each chunk's rows' hidden states [T, hidden], in chunk order."""
        if hidden is None:
            return
        r = 0
        for c in chunks:
            if c.seq.is_finished:  # ended by the step before (async scheduling)
                r += c.num_tokens
                continue
            state = self._state(c.seq)
            end = c.start + c.num_tokens
            first = max(c.start, end - self.max_waiting, state.origin + state.exact)
            if first < end:  # a copy of the rows kept, not a view of the pass's
                rows = hidden[r + first - c.start : r + c.num_tokens].clone()
                for j, position in enumerate(range(first, end)):
                    state.waiting[position] = rows[j]
            r += c.num_tokens
            if len(state.waiting) > self.max_waiting:  # not proposing: it starts afresh later
                for position in sorted(state.waiting)[: -self.max_waiting]:
                    del state.waiting[position]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        inputs: dict[int, tuple[list[int], torch.Tensor]] = {}  # row -> its tokens, states
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            if k > 0:
                caught = self._catch_up(seq)
                if caught is not None:
                    inputs[i] = caught
        for j in range(max(ks, default=0)):
            rows = [i for i in inputs if j < ks[i] and self._reserve(seqs[i], inputs[i][0])]
            for i in [i for i in inputs if j == 0 and i not in rows]:  # no blocks: its
                self._reset(seqs[i])  # catch-up is lost, it starts afresh at the next rows
                del inputs[i]
            if not rows:
                break
            states = [self._state(seqs[i]) for i in rows]
            chunks = [
                SeqChunk(inputs[i][0], s.seq.num_computed_tokens, s.seq.block_ids)
                for i, s in zip(rows, states, strict=True)
            ]
            batch = ForwardBatch.build(chunks, self.blocks.block_size, self.mtp.device)
            previous = torch.cat([inputs[i][1] for i in rows])
            logits, h = self.mtp.forward(batch, self.kv, previous)
            ends = torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0) - 1
            for r, (i, s) in enumerate(zip(rows, states, strict=True)):
                s.seq.num_computed_tokens += len(inputs[i][0])
                token, q = draft_token(logits[r, : self.vocab_size], seqs[i], j, coupled=True)
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
                inputs[i] = ([token], h[int(ends[r]) : int(ends[r]) + 1])
        return [
            Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)
        ]

    def _catch_up(self, seq: Sequence) -> tuple[list[int], torch.Tensor] | None:
        """The layer's inputs for the indices it lacks up to position m - 1 (m: the target's
        computed length): tokens t[p + 1] and states h[p]; None if it has no state at m - 1."""
        state, m = self._state(seq), seq.num_computed_tokens
        state.seq.num_computed_tokens = state.exact  # the chained entries go
        self.blocks.truncate(state.seq)
        if m - 1 not in state.waiting and state.origin + state.exact < m:
            return None
        first = state.origin + state.exact
        if any(p not in state.waiting for p in range(first, m)):  # a gap: start at the run
            start = m - 1
            while start - 1 in state.waiting:
                start -= 1
            self.blocks.release(state.seq)
            state.seq.num_computed_tokens = state.exact = 0
            state.origin, first = start, start
        positions = range(first, m)
        if not positions:  # nothing new: redraft from the last index's own input
            return None
        state.seq.token_ids = seq.token_ids[state.origin + 1 : m + 1]
        rows = torch.stack([state.waiting.pop(p) for p in positions])
        for p in [p for p in state.waiting if p < m]:
            del state.waiting[p]
        state.exact = m - state.origin
        return seq.token_ids[first + 1 : m + 1], rows

    def _reserve(self, seq: Sequence, tokens: list[int]) -> bool:
        """Blocks for the layer's next tokens of seq; False (nothing changed) if none free."""
        own = self._state(seq).seq
        own.token_ids = [*own.token_ids[: own.num_computed_tokens], *tokens]
        try:
            self.blocks.allocate(own, len(tokens))
        except NoFreeBlocks:
            return False
        return True

    def _reset(self, seq: Sequence) -> None:
        state = self._state(seq)
        self.blocks.release(state.seq)
        state.seq.num_computed_tokens = state.exact = 0
        state.origin, state.waiting = seq.num_computed_tokens, {}

    def _state(self, seq: Sequence) -> _State:
        key = (seq.request_id, seq.index)
        state = self.states.get(key)
        if state is None:
            own = Sequence(seq.request_id, seq.index, 0, [], seq.params, seq.seed, 0)
            state = self.states[key] = _State(own)
        return state

    def finished(self, seq: Sequence) -> None:
        state = self.states.pop((seq.request_id, seq.index), None)
        if state is not None:
            self.blocks.release(state.seq)
