"""Fetch a prompt's KV from the store, or compute it: decided by what the worker measures.

Two rates, each smoothed over the last requests (an exponential moving average, weight
`ALPHA` for the newest sample):

- The store link (`LinkRate`): every store read's bytes and seconds. A read of little data
  (under SMALL bytes) is a round trip; a large one, its bytes over the seconds past the round
  trip. So a read of `n` bytes in `c` calls is expected to take `c * rtt + n / bytes_per_s`:
  checksums and decoding included, as the reads see them.
- The prompt rate (`PromptRate`): every prompt the worker computed, its tokens and the seconds
  to its first token, at whatever load the worker had. Work grows faster than tokens: a token
  at position p attends to p others, so a prompt's `n` tokens after `s` cached ones are
  `n + (s*n + n*n/2) / K` units of work, K the context length at which a token's attention
  costs what its weights do (about params / (2 * layers * q_size)). The rate is seconds per
  unit, so that one measurement predicts prompts of every length and offset.

`Choice.plan` then compares the blocks' read with their computation: fetch when the read is
expected to be faster (or when either rate is still unknown: the read measures the link); else
compute. A link whose last measurement is older than RESAMPLE_S is measured again with one
batch of blocks (their reading cannot cost much), the rest computed.

`--kv-fetch always|never` overrides the choice (a benchmark's two sides; a user who knows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.model.config import ModelConfig

ALPHA = 0.3  # the newest sample's weight
SMALL = 64 << 10  # bytes: a read of less is a round trip
RESAMPLE_S = 30.0  # seconds after which the link's rate is measured again
MIN_PROMPT = 32  # tokens: a shorter computation is mostly fixed cost, not measured


def smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass
class LinkRate:
    rtt: float | None = None  # seconds
    # seconds per byte, smoothed as such: averaging bytes/s instead would let a few fast
    # samples of the past outweigh many slow ones of now (the mean of rates favours the fast)
    per_byte: float | None = None
    at: float = 0.0  # time.monotonic() of the last large read

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.per_byte is None else 1 / self.per_byte

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < SMALL:
            self.rtt = smooth(self.rtt, seconds)
            return
        moving = max(seconds - (self.rtt or 0.0), 1e-6)
        self.per_byte = smooth(self.per_byte, moving / nbytes)
        self.at = time.monotonic()

    def seconds(self, nbytes: int, calls: int) -> float | None:
        """Expected seconds to read `nbytes` in `calls` reads; None until measured."""
        if self.per_byte is None:
            return None
        return calls * (self.rtt or 0.0) + nbytes * self.per_byte

    @property
    def stale(self) -> bool:
        return time.monotonic() - self.at > RESAMPLE_S


@dataclass
class PromptRate:
    k: float  # context tokens at which attention costs what the weights do, per token
    seconds_per_unit: float | None = None

    def work(self, start: int, n: int) -> float:
        return n + (start * n + n * n / 2) / self.k

    def observe(self, start: int, n: int, seconds: float) -> None:
        if n >= MIN_PROMPT and seconds > 0:
            self.seconds_per_unit = smooth(self.seconds_per_unit, seconds / self.work(start, n))

    def seconds(self, start: int, n: int) -> float | None:
        if self.seconds_per_unit is None:
            return None
        return self.seconds_per_unit * self.work(start, n)


def attention_k(config: ModelConfig) -> float:
    """K of a model: per token, its matrices cost 2 FLOPs per weight (the dense layers' shapes,
    the output head) and its attention 4 * layers * q_size per context token."""
    c = config
    per_layer = c.hidden_size * (2 * c.q_size + 2 * c.kv_size) + 3 * c.hidden_size * (
        c.intermediate_size
    )
    weights = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    return max(weights / (2 * c.num_layers * max(c.q_size, 1)), 1.0)


@dataclass(frozen=True)
class Plan:
    blocks: int  # leading missing blocks to read (the rest computed)
    why: str  # fetch, compute, resample, unmeasured, always, never
    fetch_s: float | None
    compute_s: float | None


class Choice:
    def __init__(self, mode: str, k: float, block_tokens: int, batch: int, pause: float) -> None:
        """`batch` blocks per read, `pause` seconds between reads (a gentle fetch's)."""
        self.mode = mode
        self.link = LinkRate()
        self.prompts = PromptRate(k)
        self.block_tokens, self.batch, self.pause = block_tokens, batch, pause
        self.block_bytes: float | None = None  # a stored block's size, as read

    def observe_read(self, nbytes: int, blocks: int, seconds: float) -> None:
        self.link.observe(nbytes, seconds)
        if blocks and nbytes:
            self.block_bytes = nbytes / blocks

    def plan(self, cached: int, missing: int) -> Plan:
        """How many of `missing` blocks (after `cached` ones the engine holds) to read."""
        if self.mode != "auto" or missing == 0:
            return Plan(missing if self.mode != "never" else 0, self.mode, None, None)
        calls = -(-missing // self.batch)
        nbytes = int(missing * (self.block_bytes or 0))
        fetch = self.link.seconds(nbytes, calls) if self.block_bytes else None
        if fetch is not None:
            fetch += (calls - 1) * self.pause
        bt = self.block_tokens
        compute = self.prompts.seconds(cached * bt, missing * bt)
        if fetch is None or compute is None:
            return Plan(missing, "unmeasured", fetch, compute)
        if fetch <= compute:
            return Plan(missing, "fetch", fetch, compute)
        if self.link.stale:
            return Plan(min(self.batch, missing), "resample", fetch, compute)
        return Plan(0, "compute", fetch, compute)
