"""One data-parallel worker's ranks on two hosts of the bed (issue 53): a tiny Qwen3-MoE's two
decode ranks, rank 0 on p0 and rank 1 on p1, meet at p0's address and exchange every MoE
layer's rows over the hosts' shaped links (gloo listens on the address that reaches the
meeting host, not the one the hostname names). Prompts sent to both ranks at once answer as
one process does, token for token; a prompt one rank computed and wrote to the bed's Redis is
read by the other (the store's keys name no rank)."""

from __future__ import annotations

import asyncio

import grpc
import redis
import torch

from kvstore.block_hash import block_hashes
from kvstore.keys import store_key
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.launcher import free_port
from services.model.loader import load_model
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params
from tests.support.bed_stack import BedWorker
from tests.support.cluster import wait_until

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
HOSTS = ["p0", "p1"]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def decode(address: str, rid: str, ids: list[int]) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        request = pb.DecodeRequest(request_id=rid, prompt_token_ids=ids, seed=0,
                                   params=to_proto_params(GREEDY), local_prefill=True)  # fmt: skip
        stream = pbg.DecodeWorkerStub(channel).Decode(request)
        return [t async for chunk in stream for t in chunk.token_ids]


async def store_hits(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return int((await pbg.DecodeWorkerStub(channel).Load(pb.LoadRequest())).store_hits)


async def block_keys(address: str, ids: list[int]) -> list[str]:
    """The store keys of the prompt's full blocks, in the worker's namespace."""
    async with grpc.aio.insecure_channel(address) as channel:
        ns = str((await pbg.DecodeWorkerStub(channel).Health(pb.HealthRequest())).namespace)
    return [store_key(ns, h) for h in block_hashes(ids, 16, ns)]


def test_a_workers_ranks_on_two_hosts_answer_as_one_process(bed_stack, tiny_dir, tmp_path):
    bed, path = bed_stack.bed, str(tiny_dir("qwen3_moe"))
    loaded = load_model(path, dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=128))
    meet = f"{bed.address(HOSTS[0])}:{free_port()}"
    args = ["--num-blocks", "128", "--data-parallel", "2", "--data-parallel-address", meet]
    url = bed_stack.redis.url
    ranks = [
        BedWorker(bed, host, "decode", path, url, tmp_path, *args, "--data-parallel-rank", str(r))
        for r, host in enumerate(HOSTS)
    ]
    try:
        for rank in ranks:
            rank.launch()
        for rank in ranks:
            rank.wait_ready(180)
        shares = [[prompt(n, seed=r * 10 + i) for i, n in enumerate((5, 23, 40))] for r in (0, 1)]

        async def both() -> list[list[list[int]]]:
            return await asyncio.gather(*(
                asyncio.gather(*(decode(rank.address, f"r{r}-{i}", ids)
                                 for i, ids in enumerate(share)))
                for r, (rank, share) in enumerate(zip(ranks, shares, strict=True))
            ))  # fmt: skip

        got = asyncio.run(both())
        for share, tokens in zip(shares, got, strict=True):
            expected = [o.choices[0].token_ids for o in engine.generate(share, GREEDY)]
            assert tokens == expected

        # rank 0 computes a prompt of 3 full blocks and writes them back; rank 1 reads them
        ids = prompt(50, seed=99)
        first = asyncio.run(decode(ranks[0].address, "written", ids))
        before = asyncio.run(store_hits(ranks[1].address))
        keys = asyncio.run(block_keys(ranks[0].address, ids))
        store = redis.Redis.from_url(bed_stack.redis.url)
        wait_until(lambda: store.exists(*keys) == len(keys) == 3, timeout=30)
        again = asyncio.run(decode(ranks[1].address, "read", ids))
        assert first == again == engine.generate([ids], GREEDY)[0].choices[0].token_ids
        assert asyncio.run(store_hits(ranks[1].address)) - before == 3
    finally:
        for rank in ranks:
            rank.stop(timeout=10)
