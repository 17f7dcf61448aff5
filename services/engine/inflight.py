"""A step's tokens between the device and the sequences: sampled, placed, applied.

A step's sampled tokens stay on the device (`Sampled`) until the host places them (applier.py:
written into their sequences, grammars advanced) and applies them (stops, text, deltas).

    synchronous:  schedule N | forward N | sample N | place + apply N | schedule N+1 | ...
    async:        schedule N+1 | forward N+1, meanwhile place + apply N | sample N+1 | ...

Synchronous steps are the same pipeline with nothing left in flight: a step's tokens are placed
and applied as soon as they are sampled. With async scheduling (`overlap`), a step's tokens are
placed and applied while the next step's pass computes: on a GPU because kernels are queued
asynchronously, on a CPU on a thread of its own (torch releases the GIL while it computes; the
forward pass keeps the engine's thread and its OpenMP team). Each sequence that drew a token
holds a placeholder as its last token meanwhile, and the next batch takes the token from the
device (ModelRunner.forward's `fed`), so the pass never waits for the host. What this changes,
exactly:
- A sequence that step N finishes (a stop, EOS, a stop string) was already in step N+1: the
  token it drew there is discarded and its KV row (the last token's, correct) is not named.
  Sequences whose placeholder is sure to end them (max_tokens, the model's length, a hand-off
  to a decode worker) are not scheduled again (`holds`).
- Sampling step N+1 waits for step N to be applied: penalties, seeds' positions, min_tokens
  and a grammar's mask are those of the sequence with step N's token, exactly as in a
  synchronous step.
- A sequence holding a placeholder is not admitted from the queue (a preempted one) until the
  placeholder is resolved: block hashes are never made of a placeholder.

With speculative decoding a step's proposals, and so its batch, need the tokens the step before
accepted: they are placed before the next step is scheduled (`place_early`: a copy of a few
ints once the last step's sampling is done, the proposals verified, the KV of refused ones
rolled back, a stop token or length ending the sequence before it is scheduled again); their
text is applied while the pass computes, and a stop string found then ends the sequence where
it falls, the tokens placed past it taken back. Tokens are the synchronous engine's either way:
a row's logits do not depend on its batch (docs/design.md), and every draw is seeded by (seed,
position).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.apply import Applier
from services.engine.block_manager import BlockManager
from services.engine.outputs import SequenceDelta, StepTiming
from services.engine.request import Sequence, Status, TokenLogprobs
from services.engine.runner import PLACEHOLDER
from services.engine.sampler import LogprobRows, Sampler, pick_logprobs
from services.engine.scheduler import ScheduledChunk
from services.engine.speculative import Speculator


def async_scheduling(setting: str, device: torch.device) -> bool:
    """Whether the engine overlaps its steps: `on`, or `auto` on CUDA."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


@dataclass
class Sampled:
    """A step's tokens, still on the device."""

    chunks: list[ScheduledChunk]  # those sampled, in row order: len(draft) + 1 rows each
    tokens: torch.Tensor  # [R] int64, on the device
    logprobs: LogprobRows | None
    timing: StepTiming
    logits: torch.Tensor | None = None  # the rows', where proposals are to be verified

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks]


@dataclass
class _Placed:
    """Tokens a sequence gained, on the host, not yet applied."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    timing: StepTiming


class InFlight:
    def __init__(
        self,
        applier: Applier,
        blocks: BlockManager,
        sampler: Sampler,
        speculator: Speculator | None,
        overlap: bool,
        on_cpu: bool,
    ) -> None:
        self.applier, self.blocks, self.sampler = applier, blocks, sampler
        self.speculator = speculator
        self.overlap = overlap
        # tokens placed before the next step is scheduled (its proposals depend on them), or
        # fed to it on the device
        self.early = speculator is not None
        self.sampled: Sampled | None = None
        self.placed: list[_Placed] = []
        self._ending: set[int] = set()  # sequences the placed tokens end (ids)
        self.taken_back = 0  # tokens placed past a stop string found with the text
        # on a CPU this thread applies tokens while the engine's computes the forward pass
        threaded = overlap and on_cpu
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "apply") if threaded else None

    @property
    def fed(self) -> tuple[torch.Tensor | None, list[Sequence]]:
        """What the next batch takes from the device: the sampled tokens not yet placed."""
        if self.sampled is None:
            return None, []
        return self.sampled.tokens, self.sampled.seqs

    def holds(self, seq: Sequence) -> bool:
        """Not to be scheduled now (the scheduler asks): placed tokens end it, or it holds a
        placeholder sure to end it (a length, a hand-off), or one in a sequence that is not
        running (preempted)."""
        if id(seq) in self._ending:
            return True
        if seq.token_ids[-1] != PLACEHOLDER:
            return False
        if seq.status is not Status.RUNNING or seq.num_output_tokens >= seq.params.max_tokens:
            return True
        return seq.num_tokens >= self.applier.max_model_len or self.applier.hands_off(seq)

    def launch(self, sampled: Sampled | None) -> list[SequenceDelta]:
        """A step's tokens sampled: in flight until the next step (async scheduling), else
        placed and applied now."""
        self.sampled = sampled
        if sampled is not None and not self.early:
            for seq in sampled.seqs:
                seq.token_ids.append(PLACEHOLDER)
        return [] if self.overlap else self.land()

    def place_early(self) -> None:
        """Before scheduling: place the sampled tokens the next step's proposals need."""
        if self.early:
            self._place_sampled()

    def land(self) -> list[SequenceDelta]:
        """Place and apply everything in flight."""
        self._place_sampled()
        return self._apply_placed()

    def while_computing(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, list[SequenceDelta], float]:
        """The forward pass and, meanwhile, what is in flight landed: the logits, the
        deltas, and the seconds from the pass's launch to the end of landing."""
        start = time.perf_counter()
        if not self.overlap:  # synchronous: nothing is in flight
            return forward(), [], 0.0
        if self._thread is None:  # CUDA: the kernels are queued, the host goes on
            logits = forward()
            return logits, self.land(), time.perf_counter() - start
        landed = self._thread.submit(self._timed_land)  # the forward keeps this thread's
        try:  # OpenMP team
            logits = forward()
        finally:  # a failed pass too: nothing touches the engine while the tokens land
            deltas, t_landed = landed.result()
        return logits, deltas, t_landed - start

    def _timed_land(self) -> tuple[list[SequenceDelta], float]:
        return self.land(), time.perf_counter()

    def _place_sampled(self) -> None:
        """Bring the sampled tokens to the host, verify proposals, place what is kept."""
        sampled, self.sampled = self.sampled, None
        if sampled is None:
            return
        tokens = sampled.tokens.tolist()
        params = [c.seq.params for c in sampled.chunks for _ in range(len(c.draft) + 1)]
        logprobs: list[TokenLogprobs | None] = pick_logprobs(sampled.logprobs, tokens, params)
        r = 0
        for c in sampled.chunks:
            n = len(c.draft) + 1
            kept, lps = tokens[r : r + n], logprobs[r : r + n]
            if c.seq.is_finished:  # aborted since (Engine.abort dropped its placeholder)
                r += n
                continue
            if c.draft:
                assert self.speculator is not None and sampled.logits is not None
                rows = sampled.logits[r : r + n]
                kept = self.speculator.keep(c.seq, c.draft, rows, kept, lps, self.sampler)
            r += n
            self.placed.append(self._place(c, kept, lps, sampled.timing))

    def _place(
        self,
        chunk: ScheduledChunk,
        kept: list[int],
        logprobs: list[TokenLogprobs | None],
        timing: StepTiming,
    ) -> _Placed:
        """Put the kept tokens in the sequence, up to one that ends it (a stop token, its
        length, a hand-off), with their KV counted; roll back the KV of the proposals
        refused."""
        seq = chunk.seq
        if seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()
        for j, token in enumerate(kept):
            if chunk.draft:
                self.applier.computed(seq, chunk.start + 1 + j)  # the last token, draft[:j]
            if self.applier.place(seq, token) and self.early:
                self._ending.add(id(seq))
                return _Placed(seq, kept[: j + 1], logprobs[: j + 1], timing)
        if chunk.draft:
            self.blocks.truncate(seq)
        return _Placed(seq, kept, logprobs[: len(kept)], timing)

    def _apply_placed(self) -> list[SequenceDelta]:
        """Apply the placed tokens, token by token: a stop string ends the sequence where it
        falls and the tokens placed after it are taken back."""
        placed, self.placed = self.placed, []
        self._ending.clear()
        deltas = []
        for p in placed:
            seq = p.seq
            if seq.is_finished:  # aborted since
                continue
            computed = seq.num_computed_tokens
            del seq.token_ids[len(seq.token_ids) - len(p.tokens) :]  # appended again, one by one
            out = []
            for token, lp in zip(p.tokens, p.logprobs, strict=True):
                seq.token_ids.append(token)
                seq.num_computed_tokens = min(computed, seq.num_tokens)  # as when it was drawn
                out.append(self.applier.apply(seq, token, lp, p.timing))
                if seq.finish_reason is not None:
                    self.taken_back += len(p.tokens) - len(out)
                    break
            else:
                seq.num_computed_tokens = computed
            deltas.append(SequenceDelta.merge(out))
        return deltas
