"""Continuous batching: which sequences share the next forward pass, and how many tokens each.

Each step has a token budget. Running sequences go first, oldest first: one token for those
decoding, the next chunk for those still prefilling. Waiting sequences fill what budget is
left, their prompts split across steps when long (chunked prefill). When the pool runs out of
blocks, the newest running sequence is preempted: its blocks go back to the pool and it
returns to the head of the queue, to be recomputed (mostly from the prefix cache) later.

A prompt's chunk is at most `prefill_chunk_size` tokens, cut to the budget left: the step is
filled (with 30 sequences decoding, a 512-token budget still computes 482 prompt tokens).
Where a prompt is cut changes nothing in its results or its KV: the products are
row-invariant and attention sums each query over the same blocks in the same order whatever
the chunk (services/model; tests/services/engine/test_determinism.py cuts prompts at 1, 7 and
16 tokens and compares bits).

Speculative decoding: a decoding sequence's chunk may carry proposed tokens after its last
sampled one (`draft`), verified in the same pass. Scheduling reserves budget and slots for as
many as the sequence may propose (`Drafts.lookahead`), only where both are free (speculation
never preempts anyone); then every scheduled sequence's proposals are asked for at once
(`Drafts.propose`: a draft model runs them as one batch) and what is not used is given back.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from services.engine.block_manager import BlockManager
from services.engine.request import Sequence, Status
from services.settings import EngineConfig


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token of the chunk (= tokens already computed)
    num_tokens: int  # the draft included
    draft: tuple[int, ...] = ()  # proposed tokens after the sequence's last (speculation)
    # the chunk reaches the sequence's last token: a new token is sampled (as scheduled:
    # async scheduling may take placed tokens back before the step's logits are read)
    want_logits: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.start + self.num_tokens - len(self.draft)
        object.__setattr__(self, "want_logits", end == self.seq.num_tokens)


class Drafts(Protocol):
    """Speculative decoding's side of the scheduler (the engine's Speculator)."""

    def lookahead(self, seq: Sequence, num_running: int) -> int:
        """How many tokens the decoding sequence may propose this step, at most."""
        ...

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[tuple[int, ...]]:
        """The tokens proposed after each sequence's last, at most limits[i] each."""
        ...


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager,
        admit: Callable[[Sequence], int] | None = None,
        drafts: Drafts | None = None,
        hold: Callable[[Sequence], bool] | None = None,
    ) -> None:
        """`admit` gives a sequence that holds no blocks its already-computed prefix (and
        returns its length); by default the prefix cache's. `drafts`: speculative decoding
        (none by default). `hold`: sequences not to schedule now (those whose tokens in
        flight end them: services/engine/inflight.py)."""
        self.config = config
        self.blocks = blocks
        self.admit = admit or blocks.admit
        self.drafts = drafts
        self._reserved: list[tuple[int, int]] = []  # (chunk index, draft slots) this step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of arrival
        self.num_preemptions = 0
        self.hold = hold or (lambda seq: False)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(self.config.max_num_batched_tokens, out)
        self._schedule_waiting(budget, out)
        if self._reserved:
            self._fill_drafts(out)
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq to compute this step: 1 when decoding, else its next chunk, cut to
        the budget left (or past it, to end after an image whose rows attend both ways)."""
        return seq.fit_chunk(min(seq.num_uncomputed, self.config.chunk_size, budget))

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.hold(seq):
                i += 1
                continue
            n = self._chunk(seq, budget)
            if not self._make_room(seq, n):
                continue  # seq itself was preempted; running[i] is now the next one
            budget -= self._schedule(seq, n, out, budget - n, len(self.running) - i - 1)
            i += 1
        return budget

    def _lookahead(self, seq: Sequence, budget: int, after: int) -> int:
        """Slots to reserve for a decoding sequence's proposals: within the budget left and
        the slots its blocks and the free ones hold, keeping a block free for each of the
        `after` running sequences still to be scheduled."""
        if self.drafts is None or seq.is_prefilling or budget <= 0:
            return 0
        bs = self.blocks.block_size
        spare = max(0, self.blocks.num_free - after)
        room = (len(seq.block_ids) + spare) * bs - seq.num_computed_tokens - 1
        return max(0, min(budget, room, self.drafts.lookahead(seq, len(self.running))))

    def _fill_drafts(self, out: SchedulerOutput) -> None:
        """Ask for every reserved sequence's proposals at once; give back the unused slots."""
        assert self.drafts is not None
        reserved, self._reserved = self._reserved, []
        seqs = [out.chunks[i].seq for i, _ in reserved]
        drafts = self.drafts.propose(seqs, [slots for _, slots in reserved])
        for (i, slots), draft in zip(reserved, drafts, strict=True):
            c = out.chunks[i]
            out.chunks[i] = ScheduledChunk(c.seq, c.start, c.num_tokens - slots + len(draft), draft)
            self.blocks.truncate(c.seq, c.start + out.chunks[i].num_tokens)

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            # in order of arrival, past those whose images' rows are still being made
            seq = next((s for s in self.waiting if not s.awaiting_rows), None)
            if seq is None or self.hold(seq):
                break
            if not seq.block_ids:
                cached = self.admit(seq)
                if seq.status is Status.WAITING:
                    seq.num_cached_tokens = cached
            n = self._chunk(seq, budget)
            if n == 0 or self.blocks.blocks_needed(seq, n) > self.blocks.num_free:
                self.blocks.release(seq)  # waiting sequences hold no blocks
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            budget -= self._schedule(
                seq, n, out, budget - n, 0
            )  # decoding if its prefix was cached

    def _schedule(
        self, seq: Sequence, n: int, out: SchedulerOutput, budget: int = 0, after: int = 0
    ) -> int:
        """Put seq's next n tokens in the step, with slots reserved for its proposals;
        returns the budget taken."""
        slots = self._lookahead(seq, budget, after)
        self.blocks.allocate(seq, n + slots)
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n + slots))
        if slots:
            self._reserved.append((len(out.chunks) - 1, slots))
        return n + slots

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Preempt the newest running sequences until seq's chunk fits; False if seq itself
        had to go. Victims come from the tail of `running`, past seq, so none of them has a
        chunk in this step yet."""
        while self.blocks.blocks_needed(seq, n) > self.blocks.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.status = Status.PREEMPTED
        seq.times_preempted += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
