"""Where one request's time goes, from the spans pdserve writes with `--trace-file`.

    pdserve up --trace-file /tmp/pdserve-trace.jsonl &
    python -m bench.timeline --trace-file /tmp/pdserve-trace.jsonl [--input-len 128] \\
        [--output-len 64] [--base-url http://127.0.0.1:8000]

Sends one streamed completion (random tokens, temperature 0, ignore_eos) with a fresh W3C
`traceparent`, reads that trace's spans from the file (router, prefill and decode workers
append to it), and prints the path to the first token phase by phase, then the tokens after
it: the engine's step against the time between tokens at the API, and where the difference
goes (engine -> worker's gRPC send -> router -> SSE write). `--json` writes the numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import secrets
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from services.tracing import read

Span = dict[str, Any]


def send(base_url: str, input_len: int, output_len: int, trace_id: str, seed: int) -> None:
    rng = random.Random(seed)
    body = {
        "model": httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"],
        "prompt": [rng.randrange(1000, 40000) for _ in range(input_len)],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=body, headers=headers, timeout=600
    ) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass


def spans_of(path: Path, trace_id: str, timeout: float = 10.0) -> list[Span]:
    """The trace's spans once they are all in the file: the router's and, for each call the
    router made to a worker, the worker's (each process appends its own when the span ends,
    so a worker's may land after the router's)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in read(str(path)) if s["trace_id"] == trace_id] if path.exists() else []
        if complete(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def complete(spans: list[Span]) -> bool:
    parents = {s["parent_id"] for s in spans if s["service"] != "pdserve-router"}
    calls = [s for s in spans if s["service"] == "pdserve-router" and not is_root(s)]
    return any(is_root(s) for s in spans) and all(c["span_id"] in parents for c in calls)


def is_root(span: Span) -> bool:
    return bool(span["service"] == "pdserve-router" and span["name"].startswith("POST"))


def one(spans: list[Span], service: str, name: str) -> Span | None:
    found = [s for s in spans if s["service"] == service and s["name"] == name]
    return found[0] if found else None


def events(span: Span | None, name: str) -> list[dict[str, Any]]:
    return [e for e in span["events"] if e["name"] == name] if span else []


def breakdown(spans: list[Span]) -> dict[str, Any]:
    """Phases to the first token (ms from the router's receipt), and the per-token costs."""
    root = next(s for s in spans if is_root(s))
    t0 = root["start"]

    def ms(t: int) -> float:
        return (t - t0) / 1e6

    phases: list[tuple[str, float, float]] = []  # (what, at ms, took ms)

    def phase(what: str, start: int | None, end: int | None) -> None:
        if start is not None and end is not None:
            phases.append((what, ms(start), (end - start) / 1e6))

    admitted = first(events(root, "admitted"))
    phase("router: read, tokenize, validate, admit", t0, admitted)
    p_call = one(spans, "pdserve-router", "Prefill")
    p_work = one(spans, "pdserve-prefill", "Prefill")
    if p_call and p_work:
        phase("router -> prefill worker (gRPC)", p_call["start"], p_work["start"])
        fetched = first(events(p_work, "fetched"))
        phase("prefill: store lookup", p_work["start"], fetched)
        scheduled = first(events(p_work, "scheduled"))
        phase("prefill: queue (until in a step)", fetched, scheduled)
        step = events(p_work, "step")
        end_compute = step[-1]["time"] + int(step[-1]["forward_ms"] * 1e6) if step else None
        phase("prefill: compute (chunks, last forward)", scheduled, end_compute)
        stored = first(events(p_work, "stored"))
        phase("prefill: sample, wait for store writes", end_compute, stored)
        phase("prefill worker -> router (reply)", p_work["end"], p_call["end"])
    d_call = one(spans, "pdserve-router", "Decode")
    d_work = one(spans, "pdserve-decode", "Decode")
    written = events(root, "written")
    if d_call and d_work:
        phase("router -> decode worker (gRPC)", d_call["start"], d_work["start"])
        fetched = first(events(d_work, "fetched")) or d_work["start"]
        phase("decode: fetch KV from the store", d_work["start"], fetched)
        scheduled = first(events(d_work, "scheduled"))
        phase("decode: queue (until in a step)", fetched, scheduled)
        steps = events(d_work, "step")
        if d_work["attributes"].get("local_prefill") and steps:  # the prompt computed here
            done = steps[0]["time"] + int(steps[0]["forward_ms"] * 1e6)
            phase("decode: compute the prompt (chunks, last forward)", scheduled, done)
            phase("decode: sample, send the first token", done, first(events(d_work, "send")))
            phase(
                "router: first token in, SSE written",
                first(events(d_call, "chunk")),
                written[0]["time"] if written else None,
            )
    if written:
        phases.append(("first token written (TTFT at the router)", ms(written[0]["time"]), 0.0))
    return {"phases": phases, "tokens": per_token(root, d_call, d_work),
            "total_ms": (root["end"] - t0) / 1e6}  # fmt: skip


def per_token(root: Span, d_call: Span | None, d_work: Span | None) -> dict[str, float]:
    """Medians over the decoded tokens: engine step (forward, whole), the worker's send after
    the step, the hop to the router, the router's SSE write, and the API's inter-token time."""
    steps, sent = events(d_work, "step"), events(d_work, "send")
    chunks, written = events(d_call, "chunk"), events(root, "written")
    n = min(len(steps), len(sent), len(chunks))
    if n < 3:
        return {}
    steps, sent, chunks = steps[:n], sent[:n], chunks[:n]
    written = [w for w in written if w["time"] >= chunks[0]["time"]]  # not a prefill reply's
    step_starts = [s["time"] for s in steps]
    forward_end = [s["time"] + s["forward_ms"] * 1e6 for s in steps]
    write_times = written_per_chunk(chunks, written)
    api = [b - a for a, b in itertools.pairwise(write_times)]
    engine = [b - a for a, b in itertools.pairwise(step_starts)]

    def med(xs: Sequence[float]) -> float:
        return statistics.median(xs) / 1e6

    pairs = zip(chunks, sent, strict=True)
    routed = zip(write_times, chunks, strict=True)
    out: dict[str, float] = {
        "tokens": n,
        "engine_step_ms": med(engine),
        "forward_ms": statistics.median(s["forward_ms"] for s in steps),
        "step_to_sent_ms": med([e["time"] - f for e, f in zip(sent, forward_end, strict=True)]),
        "worker_to_router_ms": med([c["time"] - e["time"] for c, e in pairs]),
        "router_to_written_ms": med([w - c["time"] for w, c in routed]),
        "api_inter_token_ms": med(api),
    }
    out["serving_cost_ms"] = out["api_inter_token_ms"] - out["engine_step_ms"]
    out["serving_cost_share"] = out["serving_cost_ms"] / out["engine_step_ms"]
    return out


def written_per_chunk(chunks: list[dict[str, Any]], written: list[dict[str, Any]]) -> list[int]:
    """When each chunk's tokens were written to the client (a chunk whose text is held back,
    an unfinished stop string or character, goes out with a later one)."""
    out, w, sent_tokens, needed = [], 0, 0, 0
    for c in chunks:
        needed += c["tokens"]
        while w < len(written) and sent_tokens < needed:
            sent_tokens += written[w]["tokens"]
            w += 1
        out.append(written[w - 1]["time"] if w else c["time"])
    return out


def first(found: list[dict[str, Any]]) -> int | None:
    return found[0]["time"] if found else None


def render(result: dict[str, Any]) -> str:
    lines = [f"{'phase':<50} {'at ms':>9} {'took ms':>9}"]
    lines += [f"{what:<50} {at:>9.1f} {took:>9.1f}" for what, at, took in result["phases"]]
    t = result["tokens"]
    if t:
        lines += [
            "",
            f"per token after the first (median of {t['tokens']}):",
            f"  engine step (start to start)   {t['engine_step_ms']:7.2f} ms  "
            f"(forward pass {t['forward_ms']:.2f})",
            f"  engine -> worker hands to gRPC {t['step_to_sent_ms']:7.2f} ms",
            f"  worker -> router               {t['worker_to_router_ms']:7.2f} ms",
            f"  router -> SSE written          {t['router_to_written_ms']:7.2f} ms",
            f"  API inter-token time           {t['api_inter_token_ms']:7.2f} ms",
            f"  serving path's own cost        {t['serving_cost_ms']:7.2f} ms "
            f"({100 * t['serving_cost_share']:.1f}% of the step)",
        ]
    lines.append(f"\nwhole request: {result['total_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.timeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace-file", type=Path, required=True, help="the servers' --trace-file")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, help="prompt seed (default: a fresh one: no cache hit)")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args(argv)
    trace_id = secrets.token_hex(16)
    seed = args.seed if args.seed is not None else random.getrandbits(32)
    send(
        args.base_url.rstrip("/").removesuffix("/v1"),
        args.input_len,
        args.output_len,
        trace_id,
        seed,
    )
    spans = spans_of(args.trace_file, trace_id)
    if not any(is_root(s) for s in spans):
        print(
            f"no spans of trace {trace_id} in {args.trace_file}: was the server started "
            "with --trace-file?",
            file=sys.stderr,
        )
        return 1
    result = breakdown(spans)
    print(f"trace {trace_id}: {args.input_len} prompt tokens, {args.output_len} generated")
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
