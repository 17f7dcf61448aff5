"""Prefill -> Redis -> decode, with real processes: the same tokens as one engine, aborts that
free blocks, and blocks that vanish or rot in the store on the way."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from kvstore.block_hash import BLOCK_SIZE, block_hashes
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params
from tests.support.workers import disaggregated


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stubs(workers):
    prefill, decode = workers
    pch = grpc.aio.insecure_channel(prefill.address)
    dch = grpc.aio.insecure_channel(decode.address)
    return pbg.PrefillWorkerStub(pch), pbg.DecodeWorkerStub(dch), (pch, dch)


async def wait_idle(stub, deadline: float) -> pb.LoadReply:
    while True:
        load = await stub.Load(pb.LoadRequest())
        if (load.running == 0 and load.referenced_blocks == 0) or time.monotonic() > deadline:
            return load
        await asyncio.sleep(0.05)


def test_16_concurrent_requests_match_the_single_process_engine(workers, embedded):
    cases = []
    for i in range(16):
        params = (
            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
            if i % 2 == 0
            else SamplingParams(
                max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True
            )
        )
        cases.append((f"c{i}", prompt(20 + 21 * i, seed=i), params, 1000 + i))

    async def run():
        prefill, decode, channels = stubs(workers)
        results = await asyncio.gather(
            *[
                disaggregated(prefill, decode, rid, ids, to_proto_params(p), seed)
                for rid, ids, p, seed in cases
            ]
        )
        for ch in channels:
            await ch.close()
        return results

    results = asyncio.run(run())
    engine = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=600))
    expected = engine.generate(
        [ids for _, ids, _, _ in cases],
        [SamplingParams(**{**p.__dict__, "seed": seed}) for _, _, p, seed in cases],
    )
    for (rid, *_), (tokens, text, _), out in zip(cases, results, expected, strict=True):
        assert tokens == out.choices[0].token_ids, rid
        assert text == out.choices[0].text, rid


def test_aborting_a_stream_frees_its_blocks_on_both_workers(workers):
    async def run():
        prefill, decode, channels = stubs(workers)
        ids = prompt(300, seed=77)
        params = to_proto_params(SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        reply = await prefill.Prefill(
            pb.PrefillRequest(request_id="abort-me", prompt_token_ids=ids, params=params, seed=1)
        )
        call = decode.Decode(
            pb.DecodeRequest(
                request_id="abort-me",
                prompt_token_ids=ids,
                output_token_ids=[reply.first_token],
                params=params,
                seed=1,
            )
        )
        received = 0
        async for chunk in call:
            received += len(chunk.token_ids)
            if received >= 5:
                break
        busy = await decode.Load(pb.LoadRequest())
        assert busy.running == 1 and busy.referenced_blocks >= 19
        call.cancel()
        cancelled_at = time.monotonic()
        loads = [await wait_idle(stub, cancelled_at + 1.0) for stub in (decode, prefill)]
        elapsed = time.monotonic() - cancelled_at
        for ch in channels:
            await ch.close()
        return loads, elapsed

    loads, elapsed = asyncio.run(run())
    assert elapsed <= 1.0
    for load in loads:
        assert load.running == 0 and load.referenced_blocks == 0


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_a_block_lost_or_corrupted_in_the_store_is_recomputed(
    workers, redis_server, embedded, damage
):
    # a prompt of its own per case (hash() of a str changes with every process: two cases once
    # drew the same prompt, and the second found its blocks in the decode worker's cache)
    ids = prompt(200, seed={"delete": 401, "corrupt": 402}[damage])
    sampling = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    params = to_proto_params(sampling)

    async def run():
        prefill, decode, channels = stubs(workers)
        before = await decode.Load(pb.LoadRequest())
        request = pb.PrefillRequest(
            request_id=f"lost-{damage}", prompt_token_ids=ids, params=params, seed=3
        )
        reply = await prefill.Prefill(request)
        namespace = (await prefill.Health(pb.HealthRequest())).namespace
        sixth = block_hashes(ids, BLOCK_SIZE, namespace)[5]  # as the workers name it
        keys = redis_server.redis_cli("keys", "pdserve:kv:*").split()
        victim = next(k for k in keys if k.endswith(sixth[:16].hex()))
        if damage == "delete":
            redis_server.redis_cli("del", victim)
        else:
            redis_server.redis_cli("set", victim, "not a block")
        tokens = [reply.first_token]
        async for chunk in decode.Decode(
            pb.DecodeRequest(
                request_id=f"lost-{damage}",
                prompt_token_ids=ids,
                output_token_ids=tokens[:1],
                params=params,
                seed=3,
            )
        ):
            tokens += chunk.token_ids
        after = await decode.Load(pb.LoadRequest())
        for ch in channels:
            await ch.close()
        return tokens, before, after

    tokens, before, after = asyncio.run(run())
    engine = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    assert tokens == engine.generate([ids], sampling)[0].choices[0].token_ids
    # blocks 5.. of 12 full + a partial were recomputed: 200 - 5 * 16 tokens
    assert after.recomputed_tokens - before.recomputed_tokens == 200 - 5 * 16
    if damage == "corrupt":
        assert after.store_corrupt == before.store_corrupt + 1


def test_local_prefill_computes_everything_on_the_decode_worker(workers, embedded):
    ids = prompt(90, seed=21)
    sampling = SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True)

    async def run():
        _, decode, channels = stubs(workers)
        before = await decode.Load(pb.LoadRequest())
        tokens = []
        async for chunk in decode.Decode(
            pb.DecodeRequest(
                request_id="local",
                prompt_token_ids=ids,
                params=to_proto_params(sampling),
                seed=5,
                local_prefill=True,
            )
        ):
            tokens += chunk.token_ids
        after = await decode.Load(pb.LoadRequest())
        for ch in channels:
            await ch.close()
        return tokens, after.store_hits - before.store_hits

    tokens, store_reads = asyncio.run(run())
    engine = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    assert tokens == engine.generate([ids], sampling)[0].choices[0].token_ids
    assert store_reads == 0


def test_logs_name_the_request_at_every_hop(workers):
    prefill, decode = workers
    assert "msg=prefill request_id=c3 " in prefill.log_path.read_text()
    assert "msg=prefilled request_id=c3 " in prefill.log_path.read_text()
    decode_log = decode.log_path.read_text()
    assert "msg=decode request_id=c3 " in decode_log and "msg=decoded request_id=c3 " in decode_log
