"""Section 4: `pdserve up --no-colocated` over a local:// store, its texts against the engine's.

The store is a fresh directory under --out (removed after), shared by the two workers: the
prefill worker writes each prompt's blocks (the partial last one too), the decode worker reads
them, and its /metrics (`up --metrics-port`) counts the blocks it read and the prompt tokens it
had to compute because the store missed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.gpu_check.check import PROMPTS, Check
from bench.gpu_check.parity import engine_generate
from bench.offline import log
from services.launcher import PDSERVE, free_port

# the decode worker's /metrics (services/worker/http.py): blocks it read from the store, and
# prompt tokens it computed because the store missed
DECODE_COUNTERS = {
    "block_hits": "pdserve_kv_store_block_hits_total",
    "recomputed_tokens": "pdserve_recomputed_tokens_total",
}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie is gone but for its parent
    except (FileNotFoundError, ProcessLookupError):
        return False


class UpProcess:
    """`pdserve up` as a child: its output kept (and written to a log), its ready line waited
    for; stopping it leaves none of the processes it started running."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        env = {**os.environ, "PDSERVE_LOG_LEVEL": "warning"}
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.log_path = log_path
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with open(self.log_path, "w") as out:
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                out.write(line)

    def ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = list(self.lines)
            for i, line in enumerate(lines):
                if m := re.search(r"pdserve: ready at (http://\S+/v1)", line):
                    return m.group(1)
                if re.match(r"pdserve: \S+ exited with code", line):  # no use waiting for it
                    raise RuntimeError(" / ".join(lines[max(0, i - 3) : i + 1]))
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"pdserve up exited with code {self.process.returncode}; see {self.log_path}"
                )
            time.sleep(0.2)
        raise RuntimeError(f"pdserve up not ready in {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> list[str]:
        """SIGINT, as Ctrl-C; the names of the processes that had to be killed after."""
        children = {
            m.group(1): int(m.group(2))
            for line in list(self.lines)
            if (m := re.search(r"pdserve: (\S+) started \(pid (\d+)\)", line))
        }
        left = []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                left.append("pdserve up")
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for name, pid in children.items():
            if alive(pid):
                left.append(name)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return left


def completion(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{url}/completions", json=body, timeout=120)
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def streamed(url: str, body: dict[str, Any]) -> tuple[str, float, float]:
    """The text, TTFT (s) and decode tok/s of a streamed completion."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    pieces, times, tokens = [], [], 0
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"]:
                pieces.append(chunk["choices"][0]["text"])
                times.append(time.perf_counter() - start)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    rate = (tokens - 1) / (times[-1] - times[0]) if tokens > 1 and times[-1] > times[0] else 0.0
    return "".join(pieces), times[0], rate


def metrics_ports() -> int:
    """A free port p with p + 1 free too: `up --metrics-port p` serves the prefill worker's
    /metrics on p and the decode worker's on p + 1."""
    while True:
        port = free_port()
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port


def decode_counters(port: int) -> dict[str, int]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = {}
    for key, metric in DECODE_COUNTERS.items():
        m = re.search(rf'^{metric}{{role="decode"}} (\S+)$', text, re.MULTILINE)
        values[key] = int(float(m.group(1))) if m else 0
    return values


def serve(check: Check, store: Path, prompts: list[list[int]], numbers: dict[str, Any]) -> None:
    """Each prompt sent plain, then streamed, to one `pdserve up` stack; the texts and times
    into `numbers`, and whether the stack stopped cleanly."""
    metrics = metrics_ports()
    argv = [PDSERVE, "up", "--port", str(free_port()), "--device", str(check.device),
            "--dtype", "float32", "--kernels", "auto", "--kv-store", f"local://{store}",
            "--no-colocated", "--num-blocks", "256", "--metrics-port", str(metrics)]  # fmt: skip
    log(f"  {' '.join(argv[1:])}")
    up = UpProcess(argv, check.out / "gpu_check-up.log")
    try:
        url = up.ready(timeout=max(10.0, min(300.0, check.left())))
        model = httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]
        plain, streams = [], []
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": check.sizes.served_tokens,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            plain.append(completion(url, body))
            streams.append(streamed(url, body))
        numbers |= {"served_text": plain, "streamed_text": [s[0] for s in streams],
                    "ttft_ms": 1000 * statistics.median(s[1] for s in streams),
                    "tok_s": statistics.median(s[2] for s in streams),
                    "decode_worker": decode_counters(metrics + 1)}  # fmt: skip
    finally:
        numbers["left_running"] = up.stop()
        numbers["exit_code"] = up.process.returncode  # 0: it stopped cleanly on SIGINT


def matching(texts: list[str], expected: list[str]) -> int:
    return sum(a == b for a, b in zip(texts, expected, strict=True))


def run(check: Check, numbers: dict[str, Any]) -> bool:
    loaded, n = check.model("float32"), check.sizes.served_prompts
    # the longest first: the dry run's one prompt (18 tokens) fills a block and part of another
    prompts = sorted((loaded.tokenizer.encode(p) for p in PROMPTS), key=len, reverse=True)[:n]
    tokens = check.sizes.served_tokens
    expected = [engine_generate(loaded, [p], tokens)[0].text for p in prompts]  # each alone
    numbers |= {"prompts": n, "tokens": tokens, "engine_text": expected}
    store = Path(tempfile.mkdtemp(prefix="kv-", dir=check.out.resolve()))  # mode 0700
    try:
        serve(check, store, prompts, numbers)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    numbers["identical"] = matching(numbers["served_text"], expected)
    numbers["streamed_identical"] = matching(numbers["streamed_text"], expected)
    equal = numbers["identical"] == numbers["streamed_identical"] == n
    clean = not numbers["left_running"] and numbers["exit_code"] == 0
    read = numbers["decode_worker"]
    transferred = read["block_hits"] > 0 and read["recomputed_tokens"] == 0
    return equal and clean and transferred


def summary(n: dict[str, Any]) -> str:
    d = n["decode_worker"]
    return (
        f"{n['identical']}/{n['prompts']} texts equal the engine's "
        f"({n['streamed_identical']} streamed); the decode worker read {d['block_hits']} "
        f"blocks from the local:// store, recomputed {d['recomputed_tokens']} tokens; "
        f"TTFT {n['ttft_ms']:.0f} ms, {n['tok_s']:.1f} tok/s; left running: "
        f"{', '.join(n['left_running']) or 'none'}"
    )
