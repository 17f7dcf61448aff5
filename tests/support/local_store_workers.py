"""Processes for the local:// concurrency test (importable, for multiprocessing's spawn)."""

from __future__ import annotations

import asyncio
import time

import torch

from kvstore import open_store
from kvstore.block_hash import KVLayout
from kvstore.codec import BlockCodec, CodecError, StorageDtype

LAYOUT = KVLayout("smollm2", "bfloat16", 16, 30, 3, 64)  # 368,640-byte payloads
KEYS = [i.to_bytes(32, "little") for i in range(12)]


def writer(url: str, seconds: float, rounds_out) -> None:  # type: ignore[no-untyped-def]
    codec = BlockCodec(LAYOUT, StorageDtype.BFLOAT16)

    async def go() -> int:
        store = open_store(url, LAYOUT.namespace(), timeout=10)
        rounds, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            k = torch.full((len(KEYS), 30, 3, 64, 16), float(rounds), dtype=torch.bfloat16)
            v = torch.full((len(KEYS), 30, 3, 16, 64), -float(rounds), dtype=torch.bfloat16)
            values = codec.encode_many(k, v, KEYS, [16] * len(KEYS))
            await store.put_many(list(zip(KEYS, values, strict=True)))
            rounds += 1
        return rounds

    rounds_out.value = asyncio.run(go())


def reader(url: str, seconds: float, result) -> None:  # type: ignore[no-untyped-def]
    codec = BlockCodec(LAYOUT, StorageDtype.BFLOAT16)

    async def go() -> tuple[int, int]:
        store = open_store(url, LAYOUT.namespace(), timeout=10)
        reads = bad = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for h, value in zip(KEYS, await store.get_many(KEYS), strict=True):
                if value is None:
                    continue
                reads += 1
                try:
                    codec.check(value, h)
                except CodecError:
                    bad += 1
        return reads, bad

    result[0], result[1] = asyncio.run(go())
