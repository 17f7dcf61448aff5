"""`pdserve bench` end to end: against `pdserve up` (no failures, token counts equal to the
server's usage, result JSON and plots written; multi-turn finds more cached prefix than
random), and against a faulty server (failures counted with reasons, the run goes on)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from itertools import takewhile

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.load.cli import main as bench
from bench.load.client import Target
from bench.load.runner import LoadConfig, arrivals_forever, run
from bench.load.workloads import WorkloadConfig, build
from services.launcher import free_port
from tests.support.cluster import metrics
from tests.support.up import Up


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    kv = tmp_path_factory.mktemp("bench-kv")
    up = Up("--port", str(free_port()), "--kv-store", f"local://{kv}", "--num-blocks", "1024")
    try:
        yield up.ready()
    finally:
        up.stop()


def test_random_workload_against_pdserve_up(stack, tmp_path, capsys):
    result_file, plots = tmp_path / "run.json", tmp_path / "plots"
    code = bench([
        "--base-url", stack.removesuffix("/v1"), "--workload", "random", "--num-prompts", "40",
        "--request-rate", "8", "--input-len", "48", "--output-len", "12", "--ignore-eos",
        "--goodput", "ttft:60000", "--result-file", str(result_file), "--plot", str(plots),
        "--detailed", "--no-progress", "--seed", "3",
    ])  # fmt: skip
    assert code == 0
    result = json.loads(result_file.read_text())
    assert (result["completed"], result["failed"]) == (40, 0)
    assert result["model"] == "SmolLM2-135M-Instruct" and result["usage_reported"] is True
    requests = result["requests"]
    # the server's usage: prompts of exactly 48 tokens (built from the tokenizer), 12 out
    assert [r["input_tokens"] for r in requests] == [48] * 40
    assert [r["output_tokens"] for r in requests] == [12] * 40
    assert result["total_output_tokens"] == 480 and result["request_goodput"] > 0
    for key in ("mean_ttft_ms", "p99_itl_ms", "median_tpot_ms", "p90_e2el_ms"):
        assert result[key] > 0
    assert {p.name for p in plots.iterdir()} == {"latency_cdf.png", "throughput_over_time.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots.iterdir())
    assert "Mean TTFT (ms)" in capsys.readouterr().out


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_rag_workload_reuses_documents_approximately_where_asked(stack, tmp_path, endpoint):
    """Documents drawn from a pool of 3, shuffled per request: asked for approximate reuse,
    the server places the documents it saw before (its usage says how many tokens); asked
    exactly, none."""
    results = {}
    for reuse in ("exact", "approximate"):
        out = tmp_path / f"{reuse}.json"
        code = bench([
            "--base-url", stack.removesuffix("/v1"), "--workload", "rag", "--endpoint", endpoint,
            "--documents", "3", "--document-len", "48", "--documents-per-request", "2",
            "--num-prompts", "6", "--input-len", "8", "--output-len", "2", "--ignore-eos",
            "--max-concurrency", "1", "--no-progress", "--result-file", str(out),
            "--seed", str(len(reuse)), "--extra-body", json.dumps({"kv_reuse": reuse}),
        ])  # fmt: skip
        assert code == 0
        results[reuse] = json.loads(out.read_text())
    assert results["exact"]["total_approximate_tokens"] == 0
    assert results["approximate"]["failed"] == 0
    assert results["approximate"]["total_approximate_tokens"] >= 4 * 40  # 4 of 6 find 2 of 3


def hit_ratio_of(stack: str, args: list[str]) -> float:
    """The router's prefix-cache hit ratio over one run (from /metrics before and after)."""
    base = stack.removesuffix("/v1")
    keys = [
        ("pdserve_prefix_cache_hit_tokens_total", ()),
        ("pdserve_prefix_cache_queried_tokens_total", ()),
    ]
    before = [metrics(base).get(k, 0.0) for k in keys]
    assert bench(["--base-url", base, "--no-progress", *args]) == 0
    after = [metrics(base)[k] for k in keys]
    return (after[0] - before[0]) / (after[1] - before[1])


def test_multi_turn_finds_more_cached_prefix_than_random(stack):
    common = ["--endpoint", "chat", "--input-len", "40", "--output-len", "16", "--ignore-eos",
              "--max-concurrency", "4", "--seed", "5"]  # fmt: skip
    random_ = hit_ratio_of(stack, ["--workload", "random", "--num-prompts", "16", *common])
    multi = hit_ratio_of(
        stack, ["--workload", "multi-turn", "--num-prompts", "4", "--turns", "4", *common]
    )
    print(f"prefix-cache hit ratio: multi-turn {multi:.3f}, random {random_:.3f}")
    assert multi > random_ + 0.2


def faulty_server(
    faults: bool = True, answered: Callable[[], None] = lambda: None
) -> tuple[str, uvicorn.Server]:
    """An OpenAI-style server where (with `faults`) every third request fails with a 500,
    every third drops the connection mid-stream, and the rest stream properly (`answered` is
    called as each of those ends, before its last event)."""
    app = FastAPI()
    count = {"n": 0}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        count["n"] += 1
        kind = count["n"] % 3 if faults else 0
        if kind == 1:
            error = {"message": "boom", "type": "server_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=500)

        async def events():
            for i in range(body["max_tokens"]):
                if kind == 2 and i == 2:
                    raise RuntimeError("the server fell over")  # the connection drops
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' x'}]})}\n\n"
                await asyncio.sleep(0.001)
            usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}
            answered()
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="critical")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server


def test_failures_are_counted_with_reasons_and_the_run_goes_on(embedded):
    base, server = faulty_server()
    try:
        conversations = build(WorkloadConfig("random", 30, 8, 5, seed=2), embedded.tokenizer)
        target = Target(base, "completions", "fake")
        records, _ = asyncio.run(
            run(
                target,
                conversations,
                embedded.tokenizer,
                LoadConfig(max_concurrency=1, progress=False),
            )
        )
    finally:
        server.should_exit = True
    reasons = [r.error for r in records]
    assert len(records) == 30
    assert reasons.count("HTTP 500: boom") == 10
    dropped = [e for e in reasons if e and e.startswith("connection dropped")]
    assert len(dropped) == 10
    ok = [r for r in records if r.ok]
    assert len(ok) == 10 and all(r.output_tokens == 5 and r.usage_reported for r in ok)
    assert all(len(r.chunk_times) == 2 for r in records if r.error in dropped)


def test_rate_sweep_and_compare(stack, tmp_path, capsys):
    base = stack.removesuffix("/v1")
    sweep, plots = tmp_path / "sweep.json", tmp_path / "plots"
    args = ["--base-url", base, "--num-prompts", "6", "--input-len", "16", "--output-len", "4",
            "--ignore-eos", "--no-progress", "--goodput", "e2el:60000"]  # fmt: skip
    assert (
        bench([*args, "--sweep-rate", "2,inf", "--result-file", str(sweep), "--plot", str(plots)])
        == 0
    )
    runs = json.loads(sweep.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [2.0, "inf"]
    assert [r["completed"] for r in runs] == [6, 6]
    assert (plots / "sweep.png").exists() and (plots / "rate-2" / "latency_cdf.png").exists()
    single = tmp_path / "single.json"
    assert bench([*args, "--request-rate", "3", "--result-file", str(single)]) == 0
    capsys.readouterr()
    assert bench(["compare", str(single), str(sweep)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "metric",
        "single",
        "sweep@2.0",
        "(x",
        "single)",
        "sweep@inf",
        "(x",
        "single)",
    ]
    completed = next(line for line in table if line.startswith("completed")).split()
    assert completed == ["completed", "6", "6", "(1.00x)", "6", "(1.00x)"]


class AnswerClock:
    """A run's clock that moves a second each time the server finishes an answer, and not
    otherwise: what a run does by its duration does not depend on how fast the machine is."""

    def __init__(self) -> None:
        self.answers = 0

    def answered(self) -> None:
        self.answers += 1

    def __call__(self) -> float:
        return float(self.answers)


def test_duration_bounds_open_and_closed_loops(embedded):
    clock = AnswerClock()
    base, server = faulty_server(faults=False, answered=clock.answered)
    target = Target(base, "completions", "fake")
    conversations = build(WorkloadConfig("random", 4, 8, 3), embedded.tokenizer)
    try:
        open_loop = LoadConfig(request_rate=40, duration=1.0, progress=False)
        due = list(takewhile(lambda t: t < 1.0, arrivals_forever(conversations, open_loop)))
        records, _ = asyncio.run(run(target, conversations, embedded.tokenizer, open_loop))
        # every arrival in the second (the seed's gaps, the 4 prompts cycled) and no other
        assert len(records) == len(due) == 33 and all(r.ok for r in records)
        starts = sorted(r.start for r in records)
        assert all(start >= at - 1e-3 for start, at in zip(starts, due, strict=True))  # paced

        closed = LoadConfig(max_concurrency=2, duration=5.0, progress=False)
        closed_run = run(target, conversations, embedded.tokenizer, closed, clock)
        records, _ = asyncio.run(asyncio.wait_for(closed_run, 120))  # 120 s: only bounds a hang
        # both slots start at 0 s; each of the first four answers (1-4 s) lets its slot start
        # the next, unless the fifth answer (5 s) comes before that slot looks
        assert len(records) in (5, 6) and all(r.ok for r in records)
        assert max(r.start for r in records) <= 5.0
        in_flight = max(sum(o.start <= r.start < o.end for o in records) for r in records)
        assert in_flight <= 2
    finally:
        server.should_exit = True
