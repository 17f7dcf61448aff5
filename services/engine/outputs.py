"""What the engine hands back: per-step deltas, and whole outputs for offline use; where its
steps' time went.

Text is streamed with a hold-back: while a stop string could still be completing, its first
characters are not emitted yet, so text once sent is never taken back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from services.engine.request import FinishReason, Sequence, TokenLogprobs


@dataclass(frozen=True)
class StepTiming:
    """The engine step a token came from (wall-clock ns, for tracing)."""

    start_ns: int
    forward_end_ns: int  # the model's forward pass done; sampling follows
    num_seqs: int
    num_tokens: int


@dataclass
class StepTimes:
    """Where the time of the engine's steps went (seconds, summed over steps)."""

    steps: int = 0
    schedule: float = 0.0  # scheduling and building the batch
    forward: float = 0.0  # the model
    sample: float = 0.0  # sampling and applying the tokens (stop checks, detokenization)
    overlapped: float = 0.0  # of forward: applying the last step's tokens (async scheduling)

    def add(self, schedule: float, forward: float, sample: float, overlapped: float) -> None:
        """One step's seconds."""
        self.steps += 1
        self.schedule += schedule
        self.forward += forward
        self.sample += sample
        self.overlapped += overlapped

    @property
    def overhead_share(self) -> float:
        total = self.schedule + self.forward + self.sample
        return (self.schedule + self.sample) / total if total else 0.0


@dataclass(frozen=True)
class SequenceDelta:
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens not computed: from the local cache or a store
    num_external_tokens: int = 0  # ... of which its KV connector brought
    step: StepTiming | None = None
    scheduled_ns: int = 0  # when the sequence first entered a step (left the queue)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with the first token
    # approximate KV reuse (chunk_reuse.py): prompt tokens placed from chunks computed
    # elsewhere, and of them those computed again
    num_approximate_tokens: int = 0
    num_recomputed_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def merge(cls, deltas: Seq[SequenceDelta]) -> SequenceDelta:
        """One sequence's consecutive deltas of one step as one (speculative decoding)."""
        if len(deltas) == 1:
            return deltas[0]
        first, last = deltas[0], deltas[-1]
        return dataclasses.replace(
            last,
            token_ids=[t for d in deltas for t in d.token_ids],
            text="".join(d.text for d in deltas),
            logprobs=[lp for d in deltas for lp in d.logprobs],
            prompt_logprobs=first.prompt_logprobs,
        )

    @classmethod
    def finished_only(cls, seq: Sequence) -> SequenceDelta:
        return cls(
            seq.request_id, seq.index, [], "", [], seq.finish_reason,
            seq.prompt_len, seq.num_output_tokens, seq.num_cached_tokens, seq.num_external_tokens,
            num_approximate_tokens=seq.num_reused_tokens,
            num_recomputed_tokens=seq.num_recomputed_tokens,
        )  # fmt: skip


@dataclass(frozen=True)
class Choice:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs]
    times_preempted: int = 0

    @classmethod
    def of(cls, seq: Sequence) -> Choice:
        return cls(
            seq.index,
            seq.output_ids,
            seq.text,
            seq.finish_reason,
            list(seq.logprobs),
            seq.times_preempted,
        )


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    choices: list[Choice]
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # tokens 1.. (scoring)

    @property
    def num_computed_prompt_tokens(self) -> int:
        return len(self.prompt_ids) - self.num_cached_tokens


class StopChecker:
    """Applies one new token to a sequence's text and decides whether it is finished."""

    def __init__(self, seq: Sequence, eos_token_ids: Seq[int], max_model_len: int) -> None:
        self.seq = seq
        self.eos = eos_token_ids
        self.max_model_len = max_model_len

    def apply(
        self, token: int, step: StepTiming | None = None, hand_off: bool = False
    ) -> SequenceDelta:
        """`hand_off`: unless a stop or the length ends it, the sequence stops here unfinished
        (HANDED_OFF): its text is held back as if it went on."""
        seq, p = self.seq, self.seq.params
        detok = seq.detokenizer
        assert detok is not None
        before = len(detok.text)
        detok.add([token])
        text = detok.text
        reason = self.token_reason(token, hand_off)
        cut: int | None = None
        if reason is not FinishReason.STOP and p.stop and seq.num_output_tokens >= p.min_tokens:
            cut = self._stop_string(text, before)
            if cut is not None:
                reason = FinishReason.STOP
        final = reason is not None and reason is not FinishReason.HANDED_OFF
        if final:  # the end: cut at the stop string, or flush what is pending
            text = text[:cut] if cut is not None else text + detok.flush()
        seq.finish_reason = reason
        seq.text = text
        visible = len(text) if final else len(text) - self._hold_back()
        new_text = text[seq.emitted_chars : max(visible, seq.emitted_chars)]
        seq.emitted_chars += len(new_text)
        return SequenceDelta(
            seq.request_id,
            seq.index,
            [token],
            new_text,
            seq.logprobs[-1:] if p.logprobs is not None else [],
            reason,
            seq.prompt_len,
            seq.num_output_tokens,
            seq.num_cached_tokens,
            seq.num_external_tokens,
            step,
            seq.scheduled_ns,
            seq.prompt_logprobs if seq.num_output_tokens == 1 else [],
            seq.num_reused_tokens,
            seq.num_recomputed_tokens,
        )

    def token_reason(self, token: int, hand_off: bool = False) -> FinishReason | None:
        """Why the sequence, whose last token is `token`, ends, text aside (a stop string
        may end it too, first)."""
        seq, p = self.seq, self.seq.params
        may_stop = seq.num_output_tokens >= p.min_tokens
        if may_stop and (token in p.stop_token_ids or (token in self.eos and not p.ignore_eos)):
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return FinishReason.HANDED_OFF if hand_off else None

    def _hold_back(self) -> int:
        return max((len(s) for s in self.seq.params.stop), default=1) - 1

    def _stop_string(self, text: str, before: int) -> int | None:
        """Where the text ends if a stop string now appears in it (new text only, plus the
        tail a stop string could start in)."""
        p = self.seq.params
        start = max(0, before - self._hold_back())
        hits = [(i, s) for s in p.stop if (i := text.find(s, start)) != -1]
        if not hits:
            return None
        i, s = min(hits)
        return i + len(s) if p.include_stop_str_in_output else i
