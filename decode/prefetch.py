"""Reading a prompt's blocks while its prefill still computes them (the Prefetch RPC).

The router sends Prefetch to the decode worker it means to give a long prompt to, as it sends
the Prefill. The worker reads the prompt's blocks in order, gently (KVLink.read_run), as the
prefill writes them (chunk by chunk): a block not there yet is asked again 10 ms later (up to
160 ms while none comes). The Decode that follows (the prefill has replied: every block is
written) claims what was read, the rest is read on the spot, and the transfer has overlapped
the prefill instead of following it. A prefetch no Decode claims within PREFETCH_TTL
seconds, or aborted, or whose Decode names another prompt, is dropped. The worker's fetch
choice holds: with `--kv-fetch never` nothing is prefetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from kvstore.store import StoreUnavailable
from services.worker.kv_link import KVLink

log = logging.getLogger("pdserve.decode")
# seconds between looks for a block the prefill has not written yet: the first, doubled
# while nothing new comes (a prompt queued behind others on the prefill worker), up to the last
PREFETCH_POLL = (0.01, 0.16)
PREFETCH_TTL = 120.0  # seconds a prefetch waits for its Decode


@dataclass
class Prefetch:
    full: list[bytes]  # the prompt's full blocks' hashes
    values: list[bytes]  # read so far (b"" for leading blocks the cache held)
    claimed: asyncio.Event = field(default_factory=asyncio.Event)  # the Decode came
    task: asyncio.Task[None] | None = None
    started: float = field(default_factory=time.perf_counter)


class Prefetcher:
    def __init__(self, link: KVLink) -> None:
        self.link = link
        self.running: dict[str, Prefetch] = {}

    def start(self, request_id: str, full: list[bytes]) -> bool:
        """Start reading; False when this worker would not read the prompt (or has started)."""
        if self.link.choice.mode == "never" or request_id in self.running or not full:
            return False
        cached = self.link.cached_hashes()
        skipped = next((i for i, h in enumerate(full) if h not in cached), len(full))
        state = Prefetch(full, [b""] * skipped)
        state.task = asyncio.create_task(self._read(request_id, state))
        self.running[request_id] = state
        return True

    async def claim(self, request_id: str, full: list[bytes]) -> list[bytes] | None:
        """The blocks read for the request, once the ones written since are read too; None
        without a prefetch (or one of another prompt)."""
        state = self.running.pop(request_id, None)
        if state is None:
            return None
        state.claimed.set()
        if state.full != full:  # not this prompt's: of no use
            self._stop(state)
            return None
        assert state.task is not None
        await state.task
        return state.values

    def drop(self, request_id: str) -> bool:
        """Stop a prefetch (an Abort); whether there was one."""
        state = self.running.pop(request_id, None)
        if state is not None:
            self._stop(state)
        return state is not None

    def _stop(self, state: Prefetch) -> None:
        if state.task is not None:
            state.task.cancel()

    async def _read(self, request_id: str, state: Prefetch) -> None:
        deadline = time.monotonic() + PREFETCH_TTL
        polls, pause = 0, PREFETCH_POLL[0]
        try:
            while len(state.values) < len(state.full):
                claimed = state.claimed.is_set()  # then every block is written
                got = await self.link.read_run(state.full[len(state.values) :], True)
                state.values += got
                if len(state.values) == len(state.full) or claimed:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError
                polls += 1
                pause = PREFETCH_POLL[0] if got else min(2 * pause, PREFETCH_POLL[1])
                await asyncio.sleep(pause)  # the prefill has not written the next block yet
            log.info(
                "prefetched",
                extra={
                    "fields": {
                        "request_id": request_id,
                        "blocks": len(state.values),
                        "polls": polls,
                        "ms": 1000 * (time.perf_counter() - state.started),
                    }
                },
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.claimed.wait(), deadline - time.monotonic())
        except StoreUnavailable:
            pass  # the Decode reads (or computes) the rest
        except TimeoutError:
            pass
        if not state.claimed.is_set():  # never claimed: the memory goes
            self.running.pop(request_id, None)
