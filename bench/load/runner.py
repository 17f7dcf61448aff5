"""The load shape: when each request is sent.

Open loop: conversations start at a rate (`request_rate` per second; gaps drawn from a gamma
distribution of shape `burstiness` and mean 1/rate: 1 is Poisson, lower is burstier, higher
steadier; `inf` sends all at once). Closed loop: `max_concurrency` bounds requests in
flight (the others wait for a slot). A trace's conversations start at the trace's own times.
Turns of one conversation are sequential: each carries the answers before it.
"""

from __future__ import annotations

import asyncio
import copy
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from bench.load.client import Target, send
from bench.load.metrics import RequestRecord
from bench.load.workloads import Conversation, Tokenizer


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0  # requests sent (and not measured) before the run
    duration: float | None = None  # stop starting conversations after this many seconds
    seed: int = 0
    timeout: float = 600.0  # per request
    progress: bool = True


def arrivals(conversations: list[Conversation], load: LoadConfig) -> Iterator[float]:
    """Start time (seconds into the run) of each conversation, in order."""
    rng = random.Random(load.seed)
    t = 0.0
    for c in conversations:
        if c.arrival is not None:
            yield c.arrival
            continue
        yield t
        if math.isfinite(load.request_rate):
            shape = load.burstiness
            t += rng.gammavariate(shape, 1.0 / (load.request_rate * shape))


class Progress:
    """A one-line progress bar on stderr, redrawn at most 4 times a second."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.failed = 0
        self.start = time.monotonic()
        self._drawn = 0.0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok
        if self.enabled and (time.monotonic() - self._drawn > 0.25 or self.done == self.total):
            self._drawn = time.monotonic()
            self.draw()

    def draw(self) -> None:
        elapsed = time.monotonic() - self.start
        if self.total:
            filled = int(30 * self.done / self.total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done} requests"
        sys.stderr.write(f"\r{bar}  failed {self.failed}  {elapsed:6.1f}s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw()
            sys.stderr.write("\n")


async def run(
    target: Target,
    conversations: list[Conversation],
    tokenizer: Tokenizer,
    load: LoadConfig,
    now: Callable[[], float] = time.perf_counter,
) -> tuple[list[RequestRecord], float]:
    """Every request's record, and the run's duration in seconds (warmup excluded), on the
    clock `now` (a test's fake one)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(load.timeout, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        if load.warmup:
            warm = [
                copy.deepcopy(conversations[i % len(conversations)]) for i in range(load.warmup)
            ]
            clock = now()
            await asyncio.gather(*(send(http, target, c, 0, tokenizer, clock, now) for c in warm))
        slots = asyncio.Semaphore(load.max_concurrency or 1 << 30)
        records: list[RequestRecord] = []
        total = None if load.duration else sum(len(c.turns) for c in conversations)
        progress = Progress(total, load.progress)
        clock = now()

        async def converse(conversation: Conversation, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (now() - clock)))
            for turn in range(len(conversation.turns)):
                async with slots:
                    record = await send(http, target, conversation, turn, tokenizer, clock, now)
                records.append(record)
                progress.update(record)
                if not record.ok:
                    return  # later turns need this answer
                conversation.answers.append(record.output_text)

        source = _cycled(conversations, load)
        if load.duration is not None and not math.isfinite(load.request_rate):
            # closed loop for a while: each slot starts the next conversation when it is free
            async def slot_loop() -> None:
                while now() - clock < (load.duration or 0):
                    await converse(next(source), 0.0)

            await asyncio.gather(*(slot_loop() for _ in range(load.max_concurrency or 1)))
        else:
            tasks = []
            for conversation, at in zip(
                source, arrivals_forever(conversations, load), strict=False
            ):
                if load.duration is not None and at >= load.duration:
                    break
                tasks.append(asyncio.create_task(converse(conversation, at)))
                await asyncio.sleep(0)
            await asyncio.gather(*tasks)
        progress.close()
    duration = max((r.end for r in records), default=0.0)
    return records, duration


def _cycled(conversations: list[Conversation], load: LoadConfig) -> Iterator[Conversation]:
    """The conversations once; with a duration, again and again (fresh copies)."""
    while True:
        for c in conversations:
            yield copy.deepcopy(c)
        if load.duration is None:
            return


def arrivals_forever(conversations: list[Conversation], load: LoadConfig) -> Iterator[float]:
    """arrivals(), continued past the workload's end for runs bounded by a duration."""
    offset = 0.0
    while True:
        last = 0.0
        for t in arrivals(conversations, load):
            last = t
            yield offset + t
        if load.duration is None:
            return
        gap = 1.0 / load.request_rate if math.isfinite(load.request_rate) else 0.0
        offset += last + max(gap, 1e-3)
