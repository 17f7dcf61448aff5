"""Prompt work queued on a worker, in tokens, and how fast the worker gets through it: the
router's estimate of how long a new prompt waits for its first token there.

A worker's backlog is the uncached prompt tokens the router has sent it (a Prefill, or a
Decode that computes its prompt) whose first token has not come back. Its rate is learned
from the same answers: tokens computed over the seconds it had a backlog, both decayed with
a half-life of `HALF_LIFE` seconds, so the estimate follows the recent load (a decode worker
computing prompts between its decode steps is slower than an idle prefill worker, and the
rate says so). Until a worker has been busy `MIN_BUSY` seconds the rate is unknown, and
nothing is refused on its account.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

HALF_LIFE = 30.0  # seconds
MIN_BUSY = 1.0  # seconds of measured work before the rate is trusted


@dataclass
class Backlog:
    tokens: int = 0  # uncached prompt tokens sent and not answered
    done: float = 0.0  # decayed tokens computed
    busy: float = 0.0  # decayed seconds with tokens > 0
    since: float = field(default_factory=time.monotonic)  # last time `done`/`busy` advanced

    @property
    def rate(self) -> float | None:
        """Prompt tokens per second while busy; None until measured."""
        if self.busy < MIN_BUSY or self.done <= 0:
            return None
        return self.done / self.busy

    def wait(self, tokens: int) -> float:
        """Seconds until `tokens` more, queued behind the backlog, are computed (0 while the
        rate is unknown)."""
        rate = self.rate
        return 0.0 if rate is None else (self.tokens + tokens) / rate

    def add(self, tokens: int, now: float | None = None) -> None:
        self._advance(time.monotonic() if now is None else now)
        self.tokens += tokens

    def answered(self, sent: int, computed: int, now: float | None = None) -> None:
        """The prompt sent with `sent` tokens came back, having computed `computed` (what the
        worker did not find cached); `computed` 0 for a prompt abandoned before its answer."""
        self._advance(time.monotonic() if now is None else now)
        self.tokens -= sent
        self.done += computed
        assert self.tokens >= 0, "more backlog answered than was sent"

    def _advance(self, now: float) -> None:
        dt = max(0.0, now - self.since)
        decay = 0.5 ** (dt / HALF_LIFE)
        self.done *= decay
        # the busy indicator's decayed integral over the interval (~dt while dt << HALF_LIFE)
        self.busy = self.busy * decay + (
            HALF_LIFE / math.log(2) * (1 - decay) if self.tokens else 0
        )
        self.since = now
