"""The KV store in the colocated path (no prefill worker ran: `local_prefill`): a decode
worker reads what the store holds of a prompt and computes the rest, and writes prompt and
answer back, so a conversation's next turn on another worker imports the first turn's blocks,
and a restarted worker answers a repeated long prompt from the store. Block counts exact."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from kvstore.block_hash import block_hashes
from kvstore.keys import store_key
from services.engine.engine import Engine
from services.engine.params import SamplingParams
from services.launcher import WorkerProcess
from services.model.loader import load_model
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.settings import EngineConfig
from services.worker.convert import to_proto_params
from tests.support.dtypes import COMPUTE_DTYPES

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode(address: str, rid: str, ids: list[int]) -> tuple[list[int], pb.LoadReply, pb.LoadReply]:
    """A greedy Decode with local_prefill on the worker; its tokens and its Load before and
    after."""

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pbg.DecodeWorkerStub(channel)
            before = await stub.Load(pb.LoadRequest())
            tokens: list[int] = []
            params = to_proto_params(GREEDY)
            request = pb.DecodeRequest(
                request_id=rid, prompt_token_ids=ids, seed=1, params=params, local_prefill=True
            )
            async for chunk in stub.Decode(request):
                tokens += chunk.token_ids
            return tokens, before, await stub.Load(pb.LoadRequest())

    return asyncio.run(run())


def reference(embedded, ids: list[int]) -> list[int]:
    engine = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    return engine.generate([ids], GREEDY)[0].choices[0].token_ids


def stored_blocks(ids: list[int], output: list[int]) -> int:
    """Full blocks a finished generation writes back: its KV covers the prompt and every
    output token but the last (sampled, never fed back)."""
    return (len(ids) + len(output) - 1) // BLOCK


def namespace(address: str) -> str:
    async def ask() -> str:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await pbg.DecodeWorkerStub(channel).Health(pb.HealthRequest())
            return str(reply.namespace)

    return asyncio.run(ask())


def test_the_next_turn_on_another_worker_imports_the_first(pool, redis_server, embedded):
    first_worker, other = (w.address for w in pool[1])
    turn1 = prompt(150, seed=41)
    out1, _, _ = decode(first_worker, "turn-1", turn1)
    assert out1 == reference(embedded, turn1)
    written = stored_blocks(turn1, out1)  # 9 full blocks: 157 tokens of KV
    hashes = block_hashes(turn1 + out1, BLOCK, namespace(first_worker))[:written]
    keys = [store_key(namespace(first_worker), h) for h in hashes]
    deadline = time.monotonic() + 10  # written back off the token path, just after the end
    while int(redis_server.redis_cli("exists", *keys)) < written:
        assert time.monotonic() < deadline, "the first turn's blocks were not written back"
        time.sleep(0.05)
    turn2 = turn1 + out1 + prompt(40, seed=42)
    out2, before, after = decode(other, "turn-2", turn2)
    assert after.store_hits - before.store_hits == written
    assert after.recomputed_tokens - before.recomputed_tokens == len(turn2) - written * BLOCK
    assert out2 == reference(embedded, turn2)


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_a_restarted_worker_answers_a_repeated_prompt_from_the_store(
    dtype, embedded, embedded_dir, tmp_path
):
    """In each dtype `--dtype auto` picks here: the blocks read back give the tokens the
    engine computes alone."""
    store = f"local://{tmp_path / 'kv'}"
    worker = WorkerProcess(
        "decode", str(embedded_dir), store, tmp_path, "--num-blocks", "200", dtype=dtype
    ).start()
    try:
        ids = prompt(300, seed=43)
        first, _, _ = decode(worker.address, "before", ids)
        worker.stop()
        worker.start()
        again, before, after = decode(worker.address, "after", ids)
    finally:
        worker.stop()
    loaded = embedded if dtype == "float32" else load_model(str(embedded_dir), dtype=dtype)
    assert first == again == reference(loaded, ids)
    full = len(ids) // BLOCK  # the prompt's full blocks, all written with the answer
    assert after.store_hits - before.store_hits == full
    assert after.recomputed_tokens - before.recomputed_tokens == len(ids) - full * BLOCK


def test_a_store_unreachable_at_start_is_logged_and_prompts_are_computed(
    embedded, embedded_dir, tmp_path
):
    from services.launcher import free_port

    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    worker = WorkerProcess("decode", str(embedded_dir), nowhere, tmp_path, "--num-blocks", "64",
                           "--store-timeout", "0.2", dtype="float32").start()  # fmt: skip
    try:
        ids = prompt(40, seed=44)
        tokens, before, after = decode(worker.address, "no-store", ids)
    finally:
        worker.stop()
    assert "kv store unreachable" in worker.log_path.read_text()
    assert tokens == reference(embedded, ids)
    assert after.recomputed_tokens - before.recomputed_tokens == len(ids)
