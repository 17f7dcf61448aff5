"""Serving, end to end, against the peers: the same `pdserve bench` load (same prompts, same
arrival times) on `pdserve up` and on each peer server given, one after another on this
machine, at a sweep of request rates.

    python -m bench.serving --out results/serving [--rates 0.5,1,2,4] [--num-prompts 32] \\
        [--vllm-python /path/to/venv/bin/python --model-dir DIR] \\
        [--llamacpp-python /path/to/venv/bin/python]

Peers run as ../shared/PEERS.md says (vLLM: the CPU build in float32 on both cores;
llama.cpp's server: the GGUF itself). Writes each server's sweep JSON, a comparison table
(`pdserve bench compare`) and `serving.png` (p99 TTFT, p99 TPOT and output throughput
against the request rate).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from bench.load import report
from services.launcher import PDSERVE, free_port
from services.model import sources


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


def servers(args: argparse.Namespace) -> dict[str, list[str]]:
    """Name -> command (with {port}) of every server to measure."""
    out = {"pdserve": [PDSERVE, "up", "--port", "{port}", "--kv-store", "local://",
                       "--dtype", args.dtype]}  # fmt: skip
    if args.vllm_python:
        out["vllm"] = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(args.model_dir), "--served-model-name",
                       "SmolLM2-135M-Instruct", "--host", "127.0.0.1", "--port", "{port}",
                       "--max-model-len", "2048", "--dtype", "float32"]  # fmt: skip
    if args.llamacpp_python:
        gguf = sources.embedded_gguf()
        out["llamacpp"] = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf),
                           "--n_ctx", "2048", "--host", "127.0.0.1", "--port", "{port}",
                           "--interrupt_requests", "False", "--model_alias",
                           "SmolLM2-135M-Instruct"]  # fmt: skip
    return out


def measure(name: str, command: list[str], args: argparse.Namespace) -> Path:
    port = free_port()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="2")
    log = open(args.out / f"{name}.log", "wb")  # noqa: SIM115 (the server keeps it)
    argv = [c.replace("{port}", str(port)) for c in command]
    process = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    result = args.out / f"{name}.json"
    try:
        wait_ready(f"http://127.0.0.1:{port}", process, args.start_timeout)
        bench = [PDSERVE, "bench", "--base-url", f"http://127.0.0.1:{port}",
                 "--model", "SmolLM2-135M-Instruct", "--workload", "random",
                 "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--ignore-eos", "--seed", "0",
                 "--warmup", "2", "--sweep-rate", args.rates, "--goodput",
                 f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}",
                 "--result-file", str(result), "--plot", str(args.out / name)]  # fmt: skip
        subprocess.run(bench, check=True)
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return result


def plot(results: dict[str, Path], out: Path) -> Path:
    plt = report._pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"),
              ("output_throughput", "output tokens/s"))  # fmt: skip
    for name, path in results.items():
        runs = json.loads(path.read_text())["runs"]
        rates = [float(r["request_rate"]) for r in runs]
        for ax, (key, label) in zip(axes, panels, strict=True):
            ax.plot(rates, [r[key] for r in runs], marker="o", label=name)
            ax.set(xlabel="request rate (req/s)", ylabel=label)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Serving on this machine: the same random workload at each rate")
    fig.tight_layout()
    path = out / "serving.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/serving"))
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto", help="pdserve's compute dtype")
    p.add_argument("--slo-ttft-ms", type=float, default=2000)
    p.add_argument("--slo-tpot-ms", type=float, default=200)
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu (PEERS.md)")
    p.add_argument("--model-dir", type=Path, help="`pdserve convert --out DIR` (for vLLM)")
    p.add_argument("--llamacpp-python", help="python of a venv with llama-cpp-python[server]")
    p.add_argument("--start-timeout", type=float, default=600)
    args = p.parse_args()
    if args.vllm_python and not args.model_dir:
        p.error("--vllm-python needs --model-dir")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {name: measure(name, command, args) for name, command in servers(args).items()}
    print(report.compare(list(results.values())))
    print(f"wrote {plot(results, args.out)}")


if __name__ == "__main__":
    main()
