"""Routing policies: which worker of a role gets a request.

- round_robin: in turn.
- least_load: the fewest prompt tokens waiting to be computed (router/workers/backlog.py), then the
  fewest requests (the router's own count or the worker's, the larger); ties taken in turn.
- kv_aware: the worker believed to cache the longest prefix of the request's blocks, among
  those no busier than the least loaded by more than `imbalance` requests; between equal
  prefixes, the one holding most of the request's chunks for approximate reuse (a hit counted
  apart: it saves less than an exact one); misses go to the least loaded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from router.workers.registry import WorkerState
from services.settings import RouterSettings


class Policy:
    def __init__(self, settings: RouterSettings) -> None:
        """`settings.policy` (its choices are the policies) and `settings.imbalance`."""
        self.name = settings.policy
        self.imbalance = settings.imbalance
        self._turns: Counter[str] = Counter()  # per role: prefill and decode turn apart

    def pick(
        self,
        workers: Sequence[WorkerState],
        hashes: Sequence[bytes],
        chunks: Sequence[tuple[bytes, int]] = (),
    ) -> WorkerState:
        """One of `workers` (not empty) for a request with these block hashes (and chunks it
        may reuse approximately: Job.reuse_chunks)."""
        if self.name == "round_robin":
            return self._in_turn(workers)
        lightest = min(load(w) for w in workers)
        least = self._in_turn([w for w in workers if load(w) == lightest])
        fewest = min(w.busy for w in workers)
        if self.name == "least_load":
            return least
        balanced = [w for w in workers if w.busy - fewest <= self.imbalance]

        def hits(w: WorkerState) -> tuple[int, int]:
            return w.cached_prefix(hashes), w.cached_chunk_tokens(chunks)

        best = max(balanced, key=lambda w: (hits(w), -w.busy, w.address))
        return best if any(hits(best)) else least

    def _in_turn(self, workers: Sequence[WorkerState]) -> WorkerState:
        """The next of `workers` (all of one role) in turn: each role takes its own turns."""
        ordered = sorted(workers, key=lambda w: w.address)
        role = ordered[0].role
        self._turns[role] += 1
        return ordered[(self._turns[role] - 1) % len(ordered)]


def load(worker: WorkerState) -> tuple[int, int]:
    """Prompt tokens queued first: a worker with two long prompts is busier than one with
    three short ones."""
    return worker.backlog.tokens, worker.busy
