"""KV store throughput: our backends against the raw clients they wrap, in one run.

    python -m bench.kvstore [--redis-url redis://...] [--batches 20] [--local-dir /dev/shm/x]

Blocks of 368,640 bytes (one bf16 block of SmolLM2: 30 layers x K,V x 3 heads x 16 tokens x
64 dims x 2 bytes), 64 per batch:
- Redis: RedisStore.put_many / get_many against raw redis-py pipelined SET / GET of the same
  bytes over the same kind of connection (a redis-server is started on a free port unless
  --redis-url is given);
- local://: LocalStore against a plain in-memory copy of the same bytes;
- the codec: bytes per block and encode/decode rate for bf16 and fp8 (fp8 halves the bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import redis.asyncio as aioredis
import torch
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvstore import open_store
from kvstore.block_hash import KVLayout
from kvstore.codec import BlockCodec, StorageDtype
from services.launcher import start_redis

BLOCK_BYTES = 368_640
LAYOUT = KVLayout("smollm2", "bfloat16", 16, 30, 3, 64)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


Step = Callable[[], Awaitable[object]]


async def rates(batches: int, nbytes: int, steps: Mapping[str, Step]) -> dict[str, float]:
    """GB/s of each step: `batches` rounds, each running every step once in turn (so drift in
    the machine or the server hits all alike), after one warm-up call each; the median round
    counts (this shared machine has bursts of noise that best-of or mean would keep)."""
    for step in steps.values():
        await step()
    seen: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(batches):
        for name, step in steps.items():
            start = time.perf_counter()
            await step()
            seen[name].append(nbytes / (time.perf_counter() - start) / 1e9)
    medians = {name: statistics.median(values) for name, values in seen.items()}
    for name, value in medians.items():
        log(f"{name}: {value:.2f} GB/s")
    return medians


async def bench_redis(url: str, batch: int, batches: int) -> dict[str, float]:
    items = [(i.to_bytes(32, "little"), os.urandom(BLOCK_BYTES)) for i in range(batch)]
    nbytes = batch * BLOCK_BYTES
    store = open_store(url, LAYOUT.namespace(), timeout=10)
    # the raw client gets the connection settings RedisStore uses, so the ratio is our cost
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=16,
        timeout=10,
        socket_timeout=10,
        socket_connect_timeout=10,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
    raw = aioredis.Redis(connection_pool=pool)
    keys = [f"raw:{h.hex()}" for h, _ in items]

    async def raw_put() -> None:
        pipe = raw.pipeline(transaction=False)
        for key, (_, value) in zip(keys, items, strict=True):
            pipe.set(key, value)
        await pipe.execute()

    async def raw_get() -> None:
        pipe = raw.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        await pipe.execute()

    async def ours_put() -> None:
        await store.put_many(items)

    async def ours_get() -> None:
        await store.get_many([h for h, _ in items])

    steps = {"raw put": raw_put, "ours put": ours_put, "raw get": raw_get, "ours get": ours_get}
    out = await rates(batches, nbytes, steps)
    await raw.aclose()
    await store.close()
    return out


async def bench_local(directory: str, batch: int, batches: int) -> dict[str, float]:
    items = [(i.to_bytes(32, "little"), os.urandom(BLOCK_BYTES)) for i in range(batch)]
    nbytes = batch * BLOCK_BYTES
    store = open_store(f"local://{directory}", LAYOUT.namespace(), timeout=10)

    async def memcpy() -> None:
        for _, value in items:
            bytearray(value)

    async def put() -> None:
        await store.put_many(items)

    async def get() -> None:
        await store.get_many([h for h, _ in items])

    return await rates(batches, nbytes, {"memory copy": memcpy, "local put": put, "local get": get})


def bench_codec(batch: int) -> dict[str, float]:
    out: dict[str, float] = {}
    k = torch.randn(batch, 30, 3, 64, 16).bfloat16()
    v = torch.randn(batch, 30, 3, 16, 64).bfloat16()
    hashes = [i.to_bytes(32, "little") for i in range(batch)]
    for dtype in (StorageDtype.BFLOAT16, StorageDtype.FP8_E4M3):
        codec = BlockCodec(LAYOUT, dtype)
        start = time.perf_counter()
        values = codec.encode_many(k, v, hashes, [16] * batch)
        encode = time.perf_counter() - start
        start = time.perf_counter()
        codec.decode_many(values, hashes, torch.bfloat16)
        decode = time.perf_counter() - start
        name = dtype.name.lower()
        out[f"{name} bytes/block"] = codec.value_bytes
        out[f"{name} encode GB/s"] = batch * BLOCK_BYTES / encode / 1e9
        out[f"{name} decode GB/s"] = batch * BLOCK_BYTES / decode / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--redis-url", help="an existing Redis (default: start one)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--local-dir", default=None, help="default: a new directory in /dev/shm")
    args = p.parse_args(argv)

    redis_dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
    proc, url = (None, args.redis_url) if args.redis_url else start_redis(redis_dir)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local_dir = args.local_dir or tempfile.mkdtemp(prefix="pdserve-bench-", dir=base)
    try:
        redis_rates = asyncio.run(bench_redis(url, args.batch, args.batches))
        local_rates = asyncio.run(bench_local(local_dir, args.batch, args.batches))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
        if args.local_dir is None:
            shutil.rmtree(local_dir, ignore_errors=True)
    codec = bench_codec(args.batch)
    print(f"{args.batch} blocks of {BLOCK_BYTES:,} bytes per batch, {args.batches} batches")
    print("| path | GB/s | ratio |")
    print("| --- | ---: | ---: |")
    for op in ("put", "get"):
        ours, raw = redis_rates[f"ours {op}"], redis_rates[f"raw {op}"]
        print(f"| redis-py pipelined {op.upper()} | {raw:.2f} | |")
        print(f"| RedisStore {op}_many | {ours:.2f} | {ours / raw:.2f}x |")
    copy = local_rates["memory copy"]
    print(f"| memory copy | {copy:.2f} | |")
    for op in ("put", "get"):
        r = local_rates[f"local {op}"]
        print(f"| local:// {op}_many | {r:.2f} | {r / copy:.2f}x |")
    print()
    print("| codec | bytes/block | encode GB/s | decode GB/s |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("bfloat16", "fp8_e4m3"):
        size, enc, dec = (
            codec[f"{name} {x}"] for x in ("bytes/block", "encode GB/s", "decode GB/s")
        )
        print(f"| {name} | {size:,.0f} | {enc:.2f} | {dec:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
