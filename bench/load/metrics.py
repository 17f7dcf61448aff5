"""What a load test measures, computed from per-request timelines, as vLLM's `bench serve`,
SGLang's `bench_serving` and AIPerf define it:

- TTFT: from sending the request to the first chunk carrying output.
- ITL: every gap between consecutive output chunks of a request.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), for requests with more than one token.
- E2E latency: from sending to the last byte.
- goodput (DistServe): completed requests per second that met every SLO given.

Percentiles are numpy's (linear interpolation), reported in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds on the run's clock)."""

    start: float
    input_tokens: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of each output chunk
    end: float = 0.0
    output_tokens: int = 0
    output_text: str = ""
    usage_reported: bool = False  # token counts from the server's usage, not the tokenizer
    error: str | None = None  # why it failed; None when it completed
    turn: int = 0  # multi-turn: the turn of its conversation
    # usage's prompt tokens found cached (exact) and placed by approximate KV reuse
    cached_tokens: int = 0
    approximate_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else float("nan")

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Goodput bounds in milliseconds; None: not bounded."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str]) -> SLO:
        """From `ttft:MS tpot:MS e2el:MS` (any subset)."""
        values: dict[str, float] = {}
        for item in items:
            key, sep, value = item.partition(":")
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, not {item!r}")
            values[f"{key}_ms"] = float(value)
        return cls(**values)

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        tpot = r.tpot
        return (
            (self.ttft_ms is None or r.ttft * 1000 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms)
            and (self.e2el_ms is None or r.latency * 1000 <= self.e2el_ms)
        )

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def distribution(name: str, seconds: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pNN of `seconds`, in ms, keyed as vLLM does (`p99_ttft_ms`)."""
    values = np.asarray(seconds, dtype=np.float64) * 1000
    out = {
        f"mean_{name}_ms": float(values.mean()) if values.size else 0.0,
        f"median_{name}_ms": float(np.median(values)) if values.size else 0.0,
        f"std_{name}_ms": float(values.std()) if values.size else 0.0,
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(values, p)) if values.size else 0.0
    return out


def summarize(records: Sequence[RequestRecord], duration: float, slo: SLO) -> dict[str, Any]:
    """The run's summary, with vLLM's key names."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    reasons: dict[str, int] = {}
    for r in failed:
        assert r.error is not None
        reasons[r.error] = reasons.get(r.error, 0) + 1
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(failed),
        "failure_reasons": reasons,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "total_approximate_tokens": sum(r.approximate_tokens for r in done),
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "request_goodput": (
            sum(slo.met_by(r) for r in done) / duration if slo.given and duration else None
        ),
    }
    summary |= distribution("ttft", [r.ttft for r in done if r.chunk_times])
    summary |= distribution("tpot", [t for r in done if (t := r.tpot) is not None])
    summary |= distribution("itl", [gap for r in done for gap in r.itls])
    summary |= distribution("e2el", [r.latency for r in done])
    return summary


def timeline(records: Sequence[RequestRecord], step: float = 1.0) -> dict[str, list[float]]:
    """Per `step` seconds of the run: output tokens/s and requests in flight (for plots)."""
    if not records:
        return {"t": [], "output_throughput": [], "concurrency": []}
    end = max(r.end for r in records)
    edges = np.arange(int(end // step) + 1) * step
    tokens = np.zeros(len(edges))
    for r in records:
        if r.ok and r.chunk_times:
            per_chunk = r.output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[int(t // step)] += per_chunk
    concurrency = [sum(r.start <= t < r.end for r in records) for t in edges]
    return {
        "t": edges.tolist(),
        "output_throughput": (tokens / step).tolist(),
        "concurrency": [float(c) for c in concurrency],
    }
