"""`--quantization int8` through real processes: a prefill and a decode worker sharing a
local:// store, a router, the official client. Greedy streams give exactly the in-process
quantized engine's tokens and logprobs, in each dtype `--dtype auto` picks here. The workers'
KV namespace differs from unquantized workers' (their blocks never mix in a shared store), and
the router refuses an unquantized worker added beside them, saying both namespaces (float32)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import torch

from services.launcher import RouterProcess, WorkerProcess
from services.model.loader import load_model
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from tests.support.cluster import greedy_in_process, greedy_stream
from tests.support.dtypes import COMPUTE_DTYPES

MAX_TOKENS = 12
PROMPTS = [
    torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    for i, n in enumerate([17, 40, 64, 100])
]


def namespace(worker: WorkerProcess) -> str:
    async def ask() -> str:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            reply = await pbg.DecodeWorkerStub(channel).Health(pb.HealthRequest(), timeout=5)
            return str(reply.namespace)

    return asyncio.run(ask())


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_int8_workers_serve_the_quantized_engines_tokens(dtype, embedded_dir, tmp_path):
    model, store = str(embedded_dir), f"local://{tmp_path / 'store'}"
    args = ("--num-blocks", "200", "--quantization", "int8")
    prefill = WorkerProcess("prefill", model, store, tmp_path, *args, dtype=dtype)
    decode = WorkerProcess("decode", model, store, tmp_path, *args, dtype=dtype)
    # an unquantized worker beside them (one dtype says it): refused
    plain = WorkerProcess("decode", model, store, tmp_path, "--num-blocks", "8", dtype=dtype)
    workers = [prefill, decode, plain] if dtype == "float32" else [prefill, decode]
    router = RouterProcess(tmp_path, [prefill.address], [decode.address], "--admin-key", "root")
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        router.start()
        if plain in workers:
            assert namespace(decode) != namespace(plain)
            admin, root = f"{router.url}/admin/workers", {"Authorization": "Bearer root"}
            change = {"role": "decode", "address": plain.address}
            assert httpx.post(admin, json=change, headers=root).json()["healthy"] is False
            line = f"KV namespace {namespace(plain)}, the other workers' {namespace(decode)}"
            assert "worker refused" in router.log_path.read_text()
            assert line in router.log_path.read_text()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            served = list(pool.map(lambda p: greedy_stream(client, p, MAX_TOKENS), PROMPTS))
    finally:
        router.stop()
        for w in workers:
            w.stop()

    loaded = load_model(model, dtype=dtype, device="cpu", quantization="int8")
    want = greedy_in_process(loaded, PROMPTS, MAX_TOKENS, num_blocks=200)
    assert served == want
    assert all(len(lp) == MAX_TOKENS for _, lp in served)
