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

Speculative decoding needs the last token on the host to propose the next ones: with it on,
the engine steps synchronously.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from services.engine.kv_connector import KVConnector
from services.engine.outputs import SequenceDelta, StepTimes, StepTiming
from services.engine.prompt_scores import score_prompts
from services.engine.request import Sequence, Status, TokenLogprobs
from services.engine.sampler import LogprobRows, Sampler, pick_logprobs
from services.engine.scheduler import ScheduledChunk, Scheduler
from services.model.batch import ForwardBatch, on_device
from services.model.causal_lm import CausalLM


class Stepper(Protocol):
    """What async scheduling takes of the engine (services/engine/engine.py)."""

    model: CausalLM
    scheduler: Scheduler
    sampler: Sampler
    times: StepTimes

    def _batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch: ...
    def _forward(self, batch: ForwardBatch) -> torch.Tensor: ...
    def _computed(self, seq: Sequence, num_computed: int) -> None: ...
    def _connector(self, seq: Sequence) -> KVConnector | None: ...
    def _apply(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, step: StepTiming,
        placed: bool = False,
    ) -> SequenceDelta: ...  # fmt: skip


PLACEHOLDER = -1  # a token sampled on the device, not yet on the host


def async_scheduling(setting: str, device: torch.device, speculative: bool) -> bool:
    """Whether the engine overlaps its steps: `on`, or `auto` on CUDA; never with speculative
    decoding."""
    if speculative:
        return False
    return setting == "on" or (setting == "auto" and device.type == "cuda")


@dataclass
class _Pending:
    """A step whose tokens are still on the device."""

    seqs: list[Sequence]  # each holds a placeholder as its last token
    tokens: torch.Tensor  # [R] int64, on the device
    logprobs: LogprobRows | None
    timing: StepTiming


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
        scheduled = e.scheduler.schedule()
        if not scheduled.chunks:
            return self.resolve()
        batch = e._batch(scheduled.chunks)
        self._feed(batch, scheduled.chunks)
        t1 = time.perf_counter()
        logits, deltas, t_applied = self._overlapped(batch)
        t2 = time.perf_counter()
        timing = StepTiming(start_ns, time.time_ns(), len(scheduled.chunks), scheduled.num_tokens)
        for chunk in scheduled.chunks:
            seq = chunk.seq
            seq.scheduled_ns = seq.scheduled_ns or start_ns
            if not seq.is_finished:  # finished by the last step's token: this one is dropped
                e._computed(seq, chunk.start + chunk.num_tokens)
        sampling = [c.seq for c in scheduled.chunks if c.want_logits]
        logits = score_prompts(scheduled.chunks, logits)
        keep = [i for i, seq in enumerate(sampling) if not seq.is_finished]
        if keep:
            x = logits if len(keep) == len(sampling) else logits[keep]
            seqs = [sampling[i] for i in keep]
            tokens = e.sampler.choose(x, seqs, [()] * len(seqs))
            logprobs = e.sampler.logprob_rows(x, [s.params for s in seqs])
            for seq in seqs:
                seq.token_ids.append(PLACEHOLDER)
            self.pending = _Pending(seqs, tokens, logprobs, timing)
        e.times.steps += 1
        e.times.schedule += t1 - t0
        e.times.forward += t2 - t1
        e.times.sample += time.perf_counter() - t2
        e.times.overlapped += t_applied - t1
        return deltas

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
        if seq.num_tokens >= e.model.config.max_model_len:
            return True
        connector = e._connector(seq)
        return connector is not None and connector.hands_off(seq)
