"""The router's last requests, phase by phase, and their latencies: what the console shows
(console/page.py), made from the router's own spans (services/tracing.py), which it records
whether or not a trace file is written.

    POST /v1/... |queue | Prefill (prefill worker) |transfer| Decode (decode worker) .... |
                 ^ received                       ^ first token      ^ first chunk   ^ last

- queue: from the request line read to the first worker call (waiting for a worker, the
  prompt tokenized);
- prefill: the Prefill call, its retries included; where none ran (colocated, a short
  prompt, the store down) the decode worker computed the prompt, until its first chunk;
- transfer: from the prefill's reply to the decode worker's first chunk: the decode worker
  reading the prompt's blocks from the store, and its first step;
- decode: from the first chunk to the last.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.tracing import Span

if TYPE_CHECKING:
    from router.workers.registry import WorkerState

KEEP = 30  # requests listed
WINDOW_S = 600.0  # how long latency points are kept
POINTS = 2000  # ... and how many at most (the view sends them every second)
OPEN = 1000  # calls kept waiting for their request's span to end (a bound, not a count)
PHASES = ("queue", "prefill", "transfer", "decode")
RATE_WINDOW = 5.0  # seconds the store's rates are averaged over
STORE = ("store_hits", "store_misses", "store_bytes_read", "store_bytes_written")


class Recent:
    def __init__(
        self, keep: int = KEEP, window_s: float = WINDOW_S, clock: Callable[[], float] = time.time
    ) -> None:
        self.requests: deque[dict[str, Any]] = deque(maxlen=keep)  # newest first
        # (t, ttft, itl) in s: the newest POINTS at most, whatever the request rate
        self.points: deque[tuple[float, float, float | None]] = deque(maxlen=POINTS)
        self.window_s, self.clock = window_s, clock
        self._calls: OrderedDict[str, list[tuple[Span, int]]] = OrderedDict()  # by parent

    def export(self, span: Span, end_ns: int) -> None:
        """A span ended (the router's tracer calls this, on its event loop)."""
        if span.name in ("Prefill", "Decode"):
            self._calls.setdefault(span.parent_id, []).append((span, end_ns))
            while len(self._calls) > OPEN:
                self._calls.popitem(last=False)
        elif span.name.startswith("POST "):
            record = phases(span, end_ns, self._calls.pop(span.span_id, []))
            self.requests.appendleft(record)
            if record["ttft_ms"] is not None:
                itl = record["itl_ms"] / 1000 if record["itl_ms"] is not None else None
                self.points.append((end_ns / 1e9, record["ttft_ms"] / 1000, itl))

    def latency(self) -> list[dict[str, Any]]:
        """TTFT and inter-token latency (ms) of the requests that ended in the window."""
        since = self.clock() - self.window_s
        while self.points and self.points[0][0] < since:
            self.points.popleft()
        return [
            {"t": round(t, 3), "ttft_ms": ms(ttft), "itl_ms": None if itl is None else ms(itl)}
            for t, ttft, itl in self.points
        ]


def phases(root: Span, end_ns: int, calls: list[tuple[Span, int]]) -> dict[str, Any]:
    """One request's record: its phases (ms) from its worker calls' spans."""
    prefills = [
        (s.start_ns, e, s.attributes.get("worker", "")) for s, e in calls if s.name == "Prefill"
    ]
    decodes = [(s, e) for s, e in calls if s.name == "Decode"]
    chunks = [
        (t, int(a.get("tokens", 0))) for s, _ in decodes for t, n, a in s.events if n == "chunk"
    ]
    start = root.start_ns
    first_call = min([p[0] for p in prefills] + [s.start_ns for s, _ in decodes], default=end_ns)
    first_chunk = min((t for t, _ in chunks), default=None)
    last = max((e for _, e in decodes), default=end_ns)
    prefill_end = max((p[1] for p in prefills), default=None)
    tokens = sum(n for _, n in chunks) + (1 if prefill_end is not None else 0)
    queue = first_call - start
    transfer = 0
    if prefill_end is not None:  # the first token came with the prefill's reply
        prefill = prefill_end - first_call
        first_token: int | None = min(p[1] for p in prefills)
        transfer = (first_chunk - prefill_end) if first_chunk is not None else 0
    else:  # the decode worker computed the prompt
        prefill = (first_chunk - first_call) if first_chunk is not None else 0
        first_token = first_chunk
    decode = (last - first_chunk) if first_chunk is not None else 0
    itl = (last - first_token) / (tokens - 1) if first_token and tokens > 1 else None
    spans = (queue, prefill, transfer, decode)
    return {
        "id": root.attributes.get("request_id", ""),
        "path": root.name.removeprefix("POST "),
        "at": round(start / 1e9, 3),
        "prompt_tokens": root.attributes.get("prompt_tokens", 0),
        "tokens": tokens,
        "prefill_worker": prefills[-1][2] if prefills else None,
        "decode_worker": decodes[-1][0].attributes.get("worker") if decodes else None,
        "phases_ms": {k: ms(v / 1e9) for k, v in zip(PHASES, spans, strict=True)},
        "total_ms": ms((end_ns - start) / 1e9),
        "ttft_ms": None if first_token is None else ms((first_token - start) / 1e9),
        "itl_ms": None if itl is None else ms(itl / 1e9),
    }


def ms(seconds: float) -> float:
    return round(max(0.0, seconds) * 1000, 2)


class StoreRates:
    """The KV store as the workers see it: totals since they started, and per second over
    the last RATE_WINDOW seconds (sampled when the view is asked for)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, dict[str, int]]] = deque()
        self.last: dict[str, dict[str, int]] = {}  # by worker: its last counts
        self.totals = dict.fromkeys(STORE, 0)

    def sample(self, now: float, workers: list[WorkerState]) -> dict[str, Any]:
        for w in workers:
            counts = {k: int(getattr(w.load, k)) for k in STORE}
            before = self.last.get(w.address, dict.fromkeys(STORE, 0))
            for k in STORE:  # fewer than before: restarted, counting from 0 again
                self.totals[k] += counts[k] - before[k] if counts[k] >= before[k] else counts[k]
            self.last[w.address] = counts
        self.samples.append((now, dict(self.totals)))
        while len(self.samples) > 2 and self.samples[1][0] <= now - RATE_WINDOW:
            self.samples.popleft()
        t0, first = self.samples[0]
        span = now - t0
        rates = {k: (self.totals[k] - first[k]) / span if span > 0 else 0.0 for k in STORE}
        return {
            "hits": self.totals["store_hits"],
            "misses": self.totals["store_misses"],
            "hits_per_s": round(rates["store_hits"], 2),
            "misses_per_s": round(rates["store_misses"], 2),
            "bytes_in_per_s": round(rates["store_bytes_written"]),
            "bytes_out_per_s": round(rates["store_bytes_read"]),
            "bytes_in": self.totals["store_bytes_written"],
            "bytes_out": self.totals["store_bytes_read"],
        }
