"""Async scheduling: the host prepares the next step while the model computes this one.

    sync:  schedule N | forward N | sample N | tokens to host, apply N | schedule N+1 | ...
    async: schedule N+1 | launch forward N+1 | apply N on the host | sample N+1 | ...
                          (the device computes N+1 while the host applies N)

A step's sampled tokens stay on the device: each sequence that drew one holds a placeholder as
its last token until the next step resolves it, and that step's batch takes the token from the
device (`_feed`), so the forward pass never waits for the host. The host's part of step N
(`.tolist()`, logprobs, grammar, stop checks, detokenization, streaming) runs while step N+1
computes: on a GPU because kernels are queued asynchronously, on a CPU because they are applied
on a thread of their own (torch releases the GIL while it computes; the forward pass stays on
the engine's thread, with its OpenMP team).

What this changes, exactly:
- A sequence that step N finishes (a stop, EOS, a stop string) was already in step N+1: the
  token it drew there is discarded and its KV row (the last token's, correct) is not named.
  Sequences whose placeholder is sure to end them (max_tokens, the model's length, a hand-off
  to a decode worker) are not scheduled again.
- Sampling step N+1 waits for step N to be applied: penalties, seeds' positions, min_tokens
  and a grammar's mask (a constrained row's mask needs the matcher advanced by its previous
  token) are those of the sequence with step N's token, exactly as in a synchronous step. The
  mask is built while the forward pass runs.
- A sequence holding a placeholder is not admitted from the queue (a preempted one) until the
  placeholder is resolved: block hashes are never made of a placeholder.
Tokens are the synchronous engine's: a row's logits do not depend on its batch
(docs/design.md), and every draw is seeded by (seed, position).

With speculative decoding (`SpecOverlap`) a step's proposals, and so its batch, need the
accepted tokens of the step before on the host: each step starts by bringing them there (a
copy of a few ints once the last step's sampling is done) and verifying them; their text
(detokenization, stop strings, logprobs, the deltas) is applied while the pass computes. A
stop string found then ends the sequence exactly as above (tokens placed past it are taken
back). On a GPU with a device-side drafter (MTP), verifying on the device would let the step
start before the copy; here the drafts of n-gram and suffix lookup are made on the host.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from services.engine.block_manager import BlockManager
from services.engine.outputs import SequenceDelta, StepTimes, StepTiming, StopChecker
from services.engine.prompt_scores import score_prompts
from services.engine.request import Sequence, Status, TokenLogprobs
from services.engine.sampler import LogprobRows, Sampler, pick_logprobs
from services.engine.scheduler import ScheduledChunk, Scheduler
from services.engine.speculative import Speculator
from services.engine.structured import Grammars
from services.model.batch import ForwardBatch, on_device
from services.model.causal_lm import CausalLM


class Stepper(Protocol):
    """What async scheduling takes of the engine (services/engine/engine.py)."""

    model: CausalLM
    scheduler: Scheduler
    sampler: Sampler
    speculator: Speculator | None
    blocks: BlockManager
    grammars: Grammars
    times: StepTimes

    def _batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch: ...
    def _forward(self, batch: ForwardBatch) -> torch.Tensor: ...
    def _computed(self, seq: Sequence, num_computed: int) -> None: ...
    def _stops(self, seq: Sequence) -> StopChecker: ...
    def _hands_off(self, seq: Sequence) -> bool: ...
    def _apply(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, step: StepTiming,
        placed: bool = False, advanced: bool = False,
    ) -> SequenceDelta: ...  # fmt: skip


PLACEHOLDER = -1  # a token sampled on the device, not yet on the host


def async_scheduling(setting: str, device: torch.device) -> bool:
    """Whether the engine overlaps its steps: `on`, or `auto` on CUDA."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


@dataclass
class _Pending:
    """A step whose tokens are still on the device."""

    chunks: list[ScheduledChunk]  # those sampled, in row order: len(draft) + 1 rows each
    tokens: torch.Tensor  # [R] int64, on the device
    logprobs: LogprobRows | None
    timing: StepTiming
    logits: torch.Tensor | None = None  # the rows', where proposals are to be verified

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks]


class Overlap:
    def __init__(self, engine: Stepper) -> None:
        self.engine = engine
        self.pending: _Pending | None = None
        # on a CPU this thread applies tokens while the engine's computes the forward pass
        on_cpu = engine.model.device.type == "cpu"
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "apply") if on_cpu else None
        engine.scheduler.hold = self._hold

    def step(self) -> list[SequenceDelta]:
        e = self.engine
        t0, start_ns = time.perf_counter(), time.time_ns()
        self._verify_pending()
        scheduled = e.scheduler.schedule()
        if not scheduled.chunks:
            return self.resolve()
        batch = e._batch(scheduled.chunks)
        self._feed(batch, scheduled.chunks)
        t1 = time.perf_counter()
        logits, deltas, t_applied = self._overlapped(batch)
        t2 = time.perf_counter()
        timing = StepTiming(start_ns, time.time_ns(), len(scheduled.chunks), scheduled.num_tokens)
        live = [c for c in scheduled.chunks if not c.seq.is_finished]  # the others were ended
        if e.speculator is not None:  # by the last step's tokens: what they drew is dropped
            e.speculator.observe(scheduled.chunks, e.model)
        for chunk in scheduled.chunks:
            chunk.seq.scheduled_ns = chunk.seq.scheduled_ns or start_ns
        for chunk in live:
            if not chunk.draft:  # a draft's KV counts once verified
                e._computed(chunk.seq, chunk.start + chunk.num_tokens)
        sampling = [c for c in scheduled.chunks if c.want_logits]
        rows = [(c, j) for c in sampling for j in range(len(c.draft) + 1)]
        logits = score_prompts(scheduled.chunks, logits)
        keep = [i for i, (c, _) in enumerate(rows) if not c.seq.is_finished]
        if keep:
            x = logits if len(keep) == len(rows) else logits[keep]
            seqs = [rows[i][0].seq for i in keep]
            tokens = e.sampler.choose(x, seqs, [rows[i][0].draft[: rows[i][1]] for i in keep])
            logprobs = e.sampler.logprob_rows(x, [s.params for s in seqs])
            chunks = [c for c in sampling if not c.seq.is_finished]
            drafts = any(c.draft for c in chunks)
            self.pending = _Pending(chunks, tokens, logprobs, timing, x if drafts else None)
            self._sampled(chunks)
        e.times.steps += 1
        e.times.schedule += t1 - t0
        e.times.forward += t2 - t1
        e.times.sample += time.perf_counter() - t2
        e.times.overlapped += t_applied - t1
        return deltas

    def _verify_pending(self) -> None:
        """Before scheduling: nothing here (the pending tokens reach the batch on the device)."""

    def _sampled(self, chunks: list[ScheduledChunk]) -> None:
        for c in chunks:
            c.seq.token_ids.append(PLACEHOLDER)

    def resolve(self) -> list[SequenceDelta]:
        """Bring the pending step's tokens to the host and apply them (stops, text)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return []
        tokens = pending.tokens.tolist()
        params = [s.params for s in pending.seqs]
        logprobs: list[TokenLogprobs | None] = pick_logprobs(pending.logprobs, tokens, params)
        deltas = []
        for seq, token, lp in zip(pending.seqs, tokens, logprobs, strict=True):
            if seq.is_finished:  # aborted since (Engine.abort dropped the placeholder)
                continue
            seq.token_ids[-1] = token
            deltas.append(self.engine._apply(seq, token, lp, pending.timing, placed=True))
        return deltas

    def _feed(self, batch: ForwardBatch, chunks: list[ScheduledChunk]) -> None:
        """Put the pending step's tokens, on the device, where the batch has placeholders."""
        if self.pending is None:
            return
        row_of = {id(seq): r for r, seq in enumerate(self.pending.seqs)}
        at, rows, offset = [], [], 0
        for c in chunks:
            if c.seq.token_ids[-1] == PLACEHOLDER and c.start + c.num_tokens == c.seq.num_tokens:
                at.append(offset + c.num_tokens - 1)
                rows.append(row_of[id(c.seq)])
            offset += c.num_tokens
        if at:
            index, picked = on_device(torch.tensor([at, rows]), batch.token_ids.device)
            tokens = self.pending.tokens.index_select(0, picked)
            batch.token_ids.index_copy_(0, index, tokens)

    def _overlapped(self, batch: ForwardBatch) -> tuple[torch.Tensor, list[SequenceDelta], float]:
        """The forward pass and, meanwhile, the last step's tokens applied: the logits, the
        deltas, and when applying them ended."""
        if self._thread is None:  # CUDA: the kernels are queued, the host goes on
            logits = self.engine._forward(batch)
            deltas = self.resolve()
            return logits, deltas, time.perf_counter()
        applied = self._thread.submit(self._timed_resolve)  # the forward keeps this thread's
        try:  # OpenMP team
            logits = self.engine._forward(batch)
        finally:  # a failed pass too: nothing touches the engine while the tokens are applied
            deltas, t_applied = applied.result()
        return logits, deltas, t_applied

    def _timed_resolve(self) -> tuple[list[SequenceDelta], float]:
        return self.resolve(), time.perf_counter()

    def _hold(self, seq: Sequence) -> bool:
        """Not to be scheduled now: a placeholder sure to end the sequence (a length, a
        hand-off), or one not yet resolved in a sequence that is not running (preempted)."""
        if seq.token_ids[-1] != PLACEHOLDER:
            return False
        e = self.engine
        if seq.status is not Status.RUNNING or seq.num_output_tokens >= seq.params.max_tokens:
            return True
        return seq.num_tokens >= e.model.config.max_model_len or e._hands_off(seq)


@dataclass
class _Placed:
    """Tokens a sequence gained, on the host, their text not yet applied."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    timing: StepTiming


class SpecOverlap(Overlap):
    """Async scheduling with speculative decoding: the last step's tokens are verified and
    placed before scheduling; their text is applied while the next pass computes."""

    def __init__(self, engine: Stepper) -> None:
        super().__init__(engine)
        self.placed: list[_Placed] = []
        self._ending: set[int] = set()  # sequences the placed tokens end (ids)
        self.taken_back = 0  # tokens placed past a stop string found with the text

    def _verify_pending(self) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        e = self.engine
        tokens = pending.tokens.tolist()
        params = [c.seq.params for c in pending.chunks for _ in range(len(c.draft) + 1)]
        logprobs: list[TokenLogprobs | None] = pick_logprobs(pending.logprobs, tokens, params)
        r = 0
        for c in pending.chunks:
            n = len(c.draft) + 1
            kept, lps = tokens[r : r + n], logprobs[r : r + n]
            if c.draft and not c.seq.is_finished:
                assert e.speculator is not None and pending.logits is not None
                rows = pending.logits[r : r + n]
                kept = e.speculator.keep(c.seq, c.draft, rows, kept, lps, e.sampler)
            r += n
            if not c.seq.is_finished:  # (else aborted since)
                self.placed.append(self._place(c, kept, lps, pending.timing))

    def _sampled(self, chunks: list[ScheduledChunk]) -> None:
        """Nothing: the tokens reach the host before the next step is scheduled."""

    def _place(
        self, chunk: ScheduledChunk, kept: list[int], logprobs: list[TokenLogprobs | None],
        timing: StepTiming,
    ) -> _Placed:  # fmt: skip
        """Put the kept tokens in the sequence, up to one that ends it (a stop token, its
        length, a hand-off), with their KV counted and the grammar advanced; roll back the
        KV of the proposals refused."""
        e, seq = self.engine, chunk.seq
        for j, token in enumerate(kept):
            if chunk.draft:
                e._computed(seq, chunk.start + 1 + j)  # the last token and draft[:j]
            seq.token_ids.append(token)
            if seq.matcher is not None:
                e.grammars.advance(seq.matcher, token)
            if e._stops(seq).token_reason(token, e._hands_off(seq)) is not None:
                self._ending.add(id(seq))
                return _Placed(seq, kept[: j + 1], logprobs[: j + 1], timing)
        if chunk.draft:
            e.blocks.truncate(seq)
        return _Placed(seq, kept, logprobs[: len(kept)], timing)

    def resolve(self) -> list[SequenceDelta]:
        """Apply the placed tokens' text, token by token: a stop string ends the sequence
        where it falls and the tokens placed after it are taken back."""
        placed, self.placed = self.placed, []
        self._ending.clear()
        deltas = []
        for p in placed:
            seq = p.seq
            computed = seq.num_computed_tokens
            del seq.token_ids[len(seq.token_ids) - len(p.tokens) :]  # appended again, one by one
            out = []
            for token, lp in zip(p.tokens, p.logprobs, strict=True):
                seq.num_computed_tokens = min(computed, seq.num_tokens)  # as when it was drawn
                out.append(self.engine._apply(seq, token, lp, p.timing, advanced=True))
                if seq.finish_reason is not None:
                    self.taken_back += len(p.tokens) - len(out)
                    break
            else:
                seq.num_computed_tokens = computed
            deltas.append(SequenceDelta.merge(out))
        return deltas

    def _hold(self, seq: Sequence) -> bool:
        return id(seq) in self._ending
