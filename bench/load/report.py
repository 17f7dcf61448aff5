"""Load-test results for people: a summary table, the result JSON (vLLM's key names, plus
per-request records with --detailed), PNG plots, and runs compared side by side."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.load.metrics import RequestRecord, timeline

LATENCIES = (("ttft", "Time to first token"), ("tpot", "Time per output token"),
             ("itl", "Inter-token latency"), ("e2el", "End-to-end latency"))  # fmt: skip


def table(result: dict[str, Any]) -> str:
    """The summary as vLLM prints it: one line per figure."""
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{result['completed']}"),
        ("Failed requests", f"{result['failed']}"),
        ("Benchmark duration (s)", f"{result['duration']:.2f}"),
        ("Total input tokens", f"{result['total_input_tokens']}"),
        ("Total generated tokens", f"{result['total_output_tokens']}"),
        ("Prompt tokens cached (exact)", f"{result.get('total_cached_tokens', 0)}"),
        ("Prompt tokens reused approximately", f"{result.get('total_approximate_tokens', 0)}"),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
    for key, title in LATENCIES:
        rows.append((f"-- {title} --", ""))
        for stat in ("mean", "median", "p90", "p99"):
            rows.append(
                (f"{stat.capitalize()} {key.upper()} (ms)", f"{result[f'{stat}_{key}_ms']:.2f}")
            )
    for reason, count in result.get("failure_reasons", {}).items():
        rows.append((f"failed: {reason}", str(count)))
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(f"{name:<{width}}{value:>12}" if value else name for name, value in rows)


def records_json(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    return [
        {
            "start": r.start,
            "ttft": r.ttft if r.chunk_times else None,
            "latency": r.latency,
            "tpot": r.tpot,
            "itls": r.itls,
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "usage_reported": r.usage_reported,
            "turn": r.turn,
            "error": r.error,
        }
        for r in records
    ]


def write_json(path: Path, result: dict[str, Any]) -> None:
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None if math.isnan(value) else str(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(result), indent=2) + "\n")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'pdserve[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(records: Sequence[RequestRecord], out: Path, title: str) -> list[Path]:
    """Latency CDFs, and throughput and concurrency over time."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, name) in zip(axes.flat, LATENCIES, strict=True):
        if key == "itl":
            values = sorted(g * 1000 for r in done for g in r.itls)
        else:
            values = sorted(v * 1000 for r in done if (v := _value(r, key)) is not None)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set(
            title=name,
            xlabel="ms",
            ylabel="fraction of requests" if key != "itl" else "fraction of gaps",
        )
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: latency CDFs")
    fig.tight_layout()
    cdf = out / "latency_cdf.png"
    fig.savefig(cdf, dpi=110)
    plt.close(fig)

    series = timeline(records)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.plot(series["t"], series["output_throughput"], label="output tokens/s")
    ax.set(xlabel="seconds into the run", ylabel="output tokens/s")
    twin = ax.twinx()
    twin.plot(series["t"], series["concurrency"], color="tab:orange", label="requests in flight")
    twin.set_ylabel("requests in flight")
    fig.legend(loc="upper left", bbox_to_anchor=(0.07, 0.88))
    ax.set_title(f"{title}: throughput and concurrency over time")
    fig.tight_layout()
    over_time = out / "throughput_over_time.png"
    fig.savefig(over_time, dpi=110)
    plt.close(fig)
    return [cdf, over_time]


def _value(r: RequestRecord, key: str) -> float | None:
    if key == "ttft":
        return r.ttft if r.chunk_times else None
    if key == "tpot":
        return r.tpot
    return r.latency


def plot_sweep(results: Sequence[dict[str, Any]], out: Path) -> Path:
    """p99 TTFT and TPOT, and goodput (or throughput), against the request rate."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r["request_rate"]) for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(rates, [r["p99_ttft_ms"] for r in results], marker="o")
    axes[0].set(title="p99 TTFT", xlabel="request rate (req/s)", ylabel="ms")
    axes[1].plot(rates, [r["p99_tpot_ms"] for r in results], marker="o")
    axes[1].set(title="p99 TPOT", xlabel="request rate (req/s)", ylabel="ms")
    good = [r["request_goodput"] for r in results]
    if all(g is not None for g in good):
        axes[2].plot(rates, good, marker="o", label="goodput")
    axes[2].plot(rates, [r["request_throughput"] for r in results], marker="o", label="throughput")
    axes[2].set(title="requests/s served", xlabel="request rate (req/s)", ylabel="req/s")
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


COMPARED = (
    "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
    "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "p99_e2el_ms", "completed", "failed",
)  # fmt: skip


def compare(paths: Sequence[Path]) -> str:
    """Runs side by side; each after the first with its ratio to the first. A sweep's file
    gives one column per rate."""
    runs, names = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for run in data.get("runs", [data]):
            runs.append(run)
            names.append(Path(path).stem + (f"@{run['request_rate']}" if "runs" in data else ""))
    header = ["metric", names[0]] + [f"{n} (x {names[0]})" for n in names[1:]]
    rows = [header]
    for key in COMPARED:
        base = runs[0].get(key)
        row = [key, _fmt(base)]
        for run in runs[1:]:
            value = run.get(key)
            ratio = f" ({value / base:.2f}x)" if _number(value) and _number(base) and base else ""
            row.append(_fmt(value) + ratio)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "-" if value is None else str(value)
