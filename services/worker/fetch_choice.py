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

Or both at once (a decode worker, `split`): the first blocks computed while the last ones are
read, the head chosen where the two take equally long. Reading a prefix and then computing
the rest never beats the better of the two (each later token costs more to compute, the
same to read: the sum is concave in the split point); computing the early, cheap tokens
while the link brings the late, dear ones does, most where the two cost about the same:
taken when expected (with SPLIT_COST_S more) SPLIT_GAIN of the better whole or less. The
two halves share the worker's cores (the read's checks and copies beside the head's products),
so a split takes longer than either alone would: every split's seconds over its expected ones
are smoothed into `split_factor`, which the next splits' expectations are multiplied by (on 2
cores and a 1 Gbit/s link, splits took 1.1-1.4x their expected time, and then the plain read
was sooner; at 0.1 Gbit/s, where the read barely uses a core, they stay worth it).

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
READ_S = 0.1  # seconds a gentle read aims at, at most (see read_blocks)
SPLIT_GAIN = 0.85  # a split is taken when expected this much sooner than the better whole,
SPLIT_COST_S = 0.05  # with this added: the head's own engine request, the tail's look-up


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
    blocks: int  # missing blocks to read, after the head (the rest computed)
    why: str  # fetch, compute, split, resample, unmeasured, always, never
    fetch_s: float | None  # expected: reading every missing block
    compute_s: float | None  # expected: computing them
    head: int = 0  # split: leading missing blocks computed while the others are read
    split_s: float | None = None  # expected: the split


class Choice:
    def __init__(self, mode: str, k: float, block_tokens: int, batch: int, pause: float) -> None:
        """`batch` blocks per read, `pause` seconds between reads (a gentle fetch's)."""
        self.mode = mode
        self.link = LinkRate()
        self.prompts = PromptRate(k)
        self.block_tokens, self.batch, self.pause = block_tokens, batch, pause
        self.block_bytes: float | None = None  # a stored block's size, as read
        # a read failed (the store down, or the link slower than measured): one block per
        # read, one read at a time, until one goes through
        self.cautious = False
        self.split_factor = 1.0  # a split's seconds over its expected ones, smoothed

    def read_blocks(self) -> int:
        """Blocks per gentle read: `batch`, fewer on a link slow enough that a read of them
        would take past READ_S seconds (each read has store_timeout for itself: reads queued
        together on 0.1 Gbit/s timed out)."""
        if self.cautious:
            return 1
        rate = self.link.bytes_per_s
        if rate is None or not self.block_bytes:
            return self.batch
        return max(1, min(self.batch, int(READ_S * rate / self.block_bytes)))

    def observe_read(self, nbytes: int, blocks: int, seconds: float) -> None:
        self.link.observe(nbytes, seconds)
        if nbytes >= SMALL:
            self.cautious = False  # a read went through: the rate is measured again
        if blocks and nbytes:
            self.block_bytes = nbytes / blocks

    def observe_split(self, expected: float, seconds: float) -> None:
        """A split expected to take `expected` seconds (as planned) took `seconds`."""
        self.split_factor = smooth(self.split_factor, self.split_factor * seconds / expected)

    def plan(self, cached: int, missing: int, split: bool = False) -> Plan:
        """How many of `missing` blocks (after `cached` ones the engine holds) to read; with
        `split` (the caller can compute a head meanwhile), maybe how many to compute first."""
        if self.mode != "auto" or missing == 0:
            return Plan(missing if self.mode != "never" else 0, self.mode, None, None)
        fetch, compute = self._fetch_s(missing), self._compute_s(cached, missing)
        if fetch is None or compute is None:
            return Plan(missing, "unmeasured", fetch, compute)
        if split and missing > 1:
            head, both = self._split(cached, missing)
            both *= self.split_factor
            if both + SPLIT_COST_S < SPLIT_GAIN * min(fetch, compute):
                return Plan(missing - head, "split", fetch, compute, head, both)
        if fetch <= compute:
            return Plan(missing, "fetch", fetch, compute)
        if self.link.stale:
            return Plan(min(self.read_blocks(), missing), "resample", fetch, compute)
        return Plan(0, "compute", fetch, compute)

    def _fetch_s(self, blocks: int) -> float | None:
        if not self.block_bytes:
            return None
        calls = -(-blocks // self.read_blocks())
        seconds = self.link.seconds(int(blocks * self.block_bytes), calls)
        return None if seconds is None else seconds + (calls - 1) * self.pause

    def _compute_s(self, start: int, blocks: int) -> float | None:
        return self.prompts.seconds(start * self.block_tokens, blocks * self.block_tokens)

    def _split(self, cached: int, missing: int) -> tuple[int, float]:
        """The head (blocks computed while the rest is read) that ends both soonest, and
        when: computing grows with the head and reading shrinks, so where they cross."""

        def both(head: int) -> float:
            return max(self._compute_s(cached, head) or 0.0, self._fetch_s(missing - head) or 0.0)

        low, high = 1, missing - 1  # the first head whose computing outlasts the reading
        while low < high:
            mid = (low + high) // 2
            if (self._compute_s(cached, mid) or 0.0) >= (self._fetch_s(missing - mid) or 0.0):
                high = mid
            else:
                low = mid + 1
        head = min((h for h in (low - 1, low) if 1 <= h < missing), key=both)
        return head, both(head)
