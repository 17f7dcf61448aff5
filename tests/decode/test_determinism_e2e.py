"""Acceptance, issue 13 point 6: greedy outputs of 16 prompts at temperature 0 are identical
cold, warm, and after a decode migration, through real processes (redis-server, 2 prefill and
2 decode workers, a router), in each dtype `--dtype auto` picks on this CPU: bfloat16 where it
has bf16 instructions (skipped with the reason elsewhere), float32 everywhere. For the
embedded model and for a tiny DeepSeek-V4 (issue 32: its cache rows carry the window, the
compressors' open windows and the compressed entries, so a prefix from the store or a
migrated stream continues exactly).

    cold       fresh workers and a fresh redis: every prompt computed
    warm       the same 16 again, shifted by one on the round robin so that most land on the
               prefill worker that did not compute them: prefixes read from the store (with
               the partial last block, one token left to compute) or from the local cache
    migrated   the same 16 again; a decode worker SIGKILLed mid-stream, its streams re-issued
               to the other, which computes their output so far as a prefill chunk

Texts and each token's logprob are compared exactly, with each other and with the in-process
engine in the same dtype."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch

from services.launcher import RouterProcess, WorkerProcess
from services.model.loader import load_model
from tests.support.cluster import (
    MODEL,
    Output,
    addresses,
    greedy_in_process,
    greedy_stream,
    load,
    metrics,
)
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.redis_servers import RedisServer
from tests.support.tiny_models import save_tiny

MAX_TOKENS = 24
# one past a block (a store or cache hit then computes a single token), block-aligned, between
LENGTHS = [17, 33, 40, 49, 64, 65, 81, 100, 111, 129, 150, 16, 31, 97, 120, 200]
PROMPTS = [
    torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    for i, n in enumerate(LENGTHS)
]


@dataclass
class Cluster:
    dtype: str
    prefill: list[WorkerProcess]
    decode: list[WorkerProcess]
    router: RouterProcess


@pytest.fixture(scope="module", params=["embedded", "deepseek_v4"])
def model_dir(request, embedded_dir, tmp_path_factory) -> Path:
    if request.param == "embedded":
        return embedded_dir
    path = tmp_path_factory.mktemp("deepseek_v4")
    save_tiny("deepseek_v4", path, embedded_dir)
    return path


@pytest.fixture(scope="module", params=COMPUTE_DTYPES)
def cluster(request, model_dir, tmp_path_factory):
    dtype = request.param
    logs = tmp_path_factory.mktemp(f"determinism-{dtype}")
    redis = RedisServer(logs / "redis").start()
    model, args = str(model_dir), ("--num-blocks", "300")
    roles = ("prefill", "prefill", "decode", "decode")
    workers = [WorkerProcess(r, model, redis.url, logs, *args, dtype=dtype) for r in roles]
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        router = RouterProcess(
            logs, addresses(workers[:2]), addresses(workers[2:]), "--policy", "round_robin",
            "--health-interval", "0.5", "--served-model-name", MODEL, model=model,
        )  # fmt: skip
        try:
            yield Cluster(dtype, workers[:2], workers[2:], router.start())
        finally:
            router.stop()
    finally:
        for w in workers:
            w.stop()
        redis.stop()


def client_of(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=120)


def run_all(cluster: Cluster, during: Callable[[], None] | None = None) -> list[Output]:
    """The 16 prompts streamed at once; `during` runs once a quarter of the tokens are out."""
    client, lock, seen = client_of(cluster.router), threading.Lock(), [0]
    quarter = threading.Event()

    def on_token() -> None:
        with lock:
            seen[0] += 1
            if seen[0] >= len(PROMPTS) * MAX_TOKENS // 4:
                quarter.set()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(greedy_stream, client, p, MAX_TOKENS, on_token) for p in PROMPTS]
        if during is not None:
            assert quarter.wait(timeout=120), "no tokens streamed"
            during()
        return [f.result() for f in futures]


def counter(cluster: Cluster, name: str) -> float:
    return sum(v for (n, _), v in metrics(cluster.router.url).items() if n == name)


def kill_a_busy_decode_worker(cluster: Cluster) -> int:
    """SIGKILL the decode worker running the most streams; how many it was running."""
    running = {w: load(w).running for w in cluster.decode}
    victim = max(running, key=lambda w: running[w])
    assert victim.process is not None
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    cluster.decode.remove(victim)
    return running[victim]


def in_process(model_dir: Path, dtype: str) -> list[Output]:
    loaded = load_model(str(model_dir), dtype=dtype, device="cpu")
    return greedy_in_process(loaded, PROMPTS, MAX_TOKENS, num_blocks=300)


def test_greedy_outputs_are_identical_cold_warm_and_after_a_migration(cluster, model_dir):
    cold = run_all(cluster)
    assert counter(cluster, "pdserve_prefix_cache_hit_tokens_total") == 0
    assert all(len(lp) == MAX_TOKENS for _, lp in cold)

    client_of(cluster.router).completions.create(model=MODEL, prompt=[7], max_tokens=1)
    warm = run_all(cluster)
    assert counter(cluster, "pdserve_kv_store_hit_tokens_total") > 0, "no prefix from the store"
    assert warm == cold

    moved: list[int] = []
    migrated = run_all(cluster, lambda: moved.append(kill_a_busy_decode_worker(cluster)))
    assert moved[0] > 0, "the killed decode worker ran no stream"
    assert migrated == cold

    assert cold == in_process(model_dir, cluster.dtype)
