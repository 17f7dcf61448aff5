"""Fetch or compute on a slow link (services/worker/fetch_choice.py): a decode host behind a
link as slow as its computing (reading a prompt's blocks takes as long as computing them: 0.1
Gbit/s on the CPUs this was written on, 0.6 Gbit/s on a Zen 4) learns its link and its prompt
rate from its own requests, then splits a long prompt: its first blocks computed while the
others are read. Tokens equal to the engine's."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import redis
import torch

from kvstore.block_hash import block_hashes
from kvstore.keys import store_key
from services.engine.params import SamplingParams
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params
from tests.multihost.conftest import LINK
from tests.support.cluster import log_events, log_size, wait_until
from tests.support.netbed import Link

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode(address: str, rid: str, ids: list[int]) -> tuple[list[int], int]:
    """A local-prefill Decode's tokens, and the store hits it added on the worker."""

    async def run() -> tuple[list[int], int]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pbg.DecodeWorkerStub(channel)
            hits = (await stub.Load(pb.LoadRequest())).store_hits
            params = to_proto_params(GREEDY)
            request = pb.DecodeRequest(
                request_id=rid, prompt_token_ids=ids, seed=0, params=params, local_prefill=True
            )
            tokens = [t async for chunk in stub.Decode(request) for t in chunk.token_ids]
            return tokens, (await stub.Load(pb.LoadRequest())).store_hits - hits

    return asyncio.run(run())


def write(stack, worker, rid: str, ids: list[int]) -> int:
    """The worker computes the prompt; returns once its full blocks are in Redis, with the
    bytes of one."""
    decode(worker.address, rid, ids)

    async def namespace() -> str:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            reply = await pbg.DecodeWorkerStub(channel).Health(pb.HealthRequest())
            return str(reply.namespace)

    ns = asyncio.run(namespace())
    keys = [store_key(ns, h) for h in block_hashes(ids, 16, ns)]  # the prompt's full blocks
    store = redis.Redis.from_url(stack.redis.url)
    wait_until(lambda: store.exists(*keys) == len(keys), timeout=30)
    return int(store.strlen(keys[0]))


def fetched_lines(worker, since: int, rid: str) -> list[dict[str, str]]:
    return [
        e for e in log_events(worker, since) if e.get("msg") == "fetched" and e["request_id"] == rid
    ]


def fetched(worker, since: int, rid: str) -> dict[str, str]:
    (line,) = fetched_lines(worker, since, rid)
    return line


def learned(worker, since: int, rid: str) -> bool:
    """The worker no longer expects the link to be faster than it is: it chose not to read
    the whole prompt, or its read took no more than 1.5 times what it expected (no line: the
    read timed out)."""
    lines = fetched_lines(worker, since, rid)
    if not lines or lines[0]["choice"] not in ("fetch", "split", "compute"):
        return False
    line = lines[0]
    return line["choice"] != "fetch" or float(line["ms"]) < 1.5 * float(line["expected_fetch_ms"])


def test_a_slow_link_splits_a_long_prompt_between_computing_and_reading(bed_stack, engine):
    slow, fast = bed_stack.decode
    stack = bed_stack
    try:
        since = log_size(slow)
        start = time.perf_counter()
        decode(slow.address, "learn-compute", prompt(400, seed=41))  # the prompt rate
        seconds = time.perf_counter() - start
        # a split pays most where reading a prompt's blocks takes as long as computing them:
        # on a fast CPU computing beats 0.1 Gbit/s fivefold (nothing to split), on a slow one
        # not, so the link is set to the rate of this host's computing
        block_bytes = write(stack, fast, "write-size", prompt(40, seed=40))
        rate = 8 * block_bytes * (400 / 16) / seconds
        stack.bed.shape(slow.host, Link(rate_bit=min(1e10, max(1e7, rate))))
        # the link's rate, from reads that went through: the worker's estimate is still the
        # fast link's of earlier tests, and each read moves it a third of the way (ALPHA), so
        # it learns until a read takes what it expected (its first reads here can time out)
        for attempt in range(8):
            shared = prompt(600, seed=42 + 100 * attempt)
            write(stack, fast, f"write-{attempt}", shared)
            decode(slow.address, f"learn-link-{attempt}", shared)
            if learned(slow, since, f"learn-link-{attempt}"):
                break
        ids = prompt(2048, seed=43)
        write(stack, fast, "write-split", ids)
        tokens, hits = decode(slow.address, "split", ids)
    finally:
        stack.bed.shape(slow.host, LINK)
    assert tokens == engine.generate([ids], GREEDY)[0].choices[0].token_ids
    line = fetched(slow, since, "split")
    head = int(line["head"])
    assert line["choice"] == "split" and 0 < head < 128, json.dumps(line)
    assert float(line["expected_split_ms"]) + 50 < 0.85 * float(line["expected_compute_ms"])
    assert int(line["blocks"]) == hits == 128 - head  # the tail read (no partial block)
