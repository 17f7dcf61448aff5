"""Forged blocks (issue 13): a writer without the key replaces stored values with ones that
have a valid header, the right hash and namespace and a recomputed xxh3 checksum, but a payload
of its own. With a key, every one is refused, deleted and counted, and the tokens are
recomputed: the answer equals the unforged one."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import httpx
import numpy as np
import redis
import torch
import xxhash

from kvstore import open_store
from kvstore.block_hash import KVLayout, block_hashes
from kvstore.blocks import BlockStore
from kvstore.codec import FLAG_MAC, FORMAT, MAC_BYTES, BlockCodec, StorageDtype, mac
from kvstore.keyfile import read_key
from kvstore.keys import PREFIX, store_key
from services.launcher import RouterProcess
from tests.support.cluster import load, start_workers
from tests.support.redis_servers import RedisServer

KEY = secrets.token_hex(32).encode()


def forge(value: bytes, keep_mac: bool) -> bytes:
    """`value` with its payload zeroed and the checksum recomputed: flagged as keyed with the
    old MAC kept, or made an unkeyed value (what a writer without the key can produce)."""
    fields = list(FORMAT.unpack_from(value))
    payload = bytes(fields[-2])  # zeros, as long as the real payload (scales included)
    fields[-1] = xxhash.xxh3_64_intdigest(payload)
    if keep_mac:
        return FORMAT.pack(*fields) + payload + value[-MAC_BYTES:]
    fields[3] &= ~FLAG_MAC
    return FORMAT.pack(*fields) + payload


def payload(value: bytes) -> np.ndarray:
    """A float32 block's K and V (the workers here compute and store float32)."""
    return np.frombuffer(
        value, dtype="<f4", offset=FORMAT.size, count=FORMAT.unpack_from(value)[-2] // 4
    )


def genuine(key: bytes, value: bytes) -> bool:
    flags = FORMAT.unpack_from(value)[3]
    return bool(flags & FLAG_MAC) and mac(key, value[:-MAC_BYTES]) == value[-MAC_BYTES:]


def test_every_forged_block_is_refused_deleted_and_counted():
    """All N values forged, as in the report (1,341 of 1,341 were taken): N refused."""
    layout = KVLayout("model-a", "bfloat16", 16, 30, 3, 64)  # SmolLM2's 368,640-byte blocks
    codec = BlockCodec(layout, StorageDtype.BFLOAT16, KEY)
    n = 24
    hashes = block_hashes(list(range(16 * n)), 16, layout.namespace())
    k, v = torch.randn(n, 30, 3, 64, 16), torch.randn(n, 30, 3, 16, 64)
    values = [bytes(x) for x in codec.encode_many(k, v, hashes, [16] * n)]

    async def scenario():
        store = open_store("memory://", layout.namespace())
        blocks = BlockStore(store, codec)
        await store.put_many(
            [(h, forge(x, i % 2 == 0)) for i, (h, x) in enumerate(zip(hashes, values, strict=True))]
        )
        for h in hashes:
            assert await blocks.get_checked([h]) == []
        assert store.stats().corrupt == n
        assert await store.get_many(hashes) == [None] * n  # every one deleted
        await store.put_many(list(zip(hashes, values, strict=True)))  # recomputed, written
        got = await blocks.get_checked(hashes)
        assert [value for value, _ in got] == values and store.stats().corrupt == n

    asyncio.run(scenario())


def completion(router: RouterProcess, prompt: list[int]) -> str:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def serve_once(model: str, url: str, logs: Path, key_file: Path, prompt: list[int]):
    """Fresh prefill + decode workers (nothing cached) and a router on the store: one greedy
    completion; the answer and each worker's Load and log."""
    args = ("--num-blocks", "128", "--kv-key-file", str(key_file))
    (prefill,), (decode,) = start_workers(model, url, logs, 1, 1, *args)
    try:
        router = RouterProcess(logs, [prefill.address], [decode.address]).start()
        try:
            answer = completion(router, prompt)
        finally:
            router.stop()
        loads = load(prefill), load(decode)
    finally:
        prefill.stop()
        decode.stop()
    return answer, loads, prefill.log_path.read_text(), decode.log_path.read_text()


def test_forged_blocks_in_redis_are_refused_counted_and_recomputed(embedded_dir, tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    key_file = tmp_path / "kv.key"
    key_file.write_bytes(KEY + b"\n")
    key_file.chmod(0o600)
    key = read_key(key_file)
    gen = torch.Generator().manual_seed(13)
    prompt = torch.randint(100, 49000, (150,), generator=gen).tolist()  # 9 blocks + 6 tokens
    try:
        logs = tmp_path / "run1"
        logs.mkdir()
        unforged, _, log, _ = serve_once(str(embedded_dir), server.url, logs, key_file, prompt)
        assert "no kv_key_file" not in log
        client = redis.Redis.from_url(server.url)
        names = client.keys(f"{PREFIX}*")
        namespace = names[0].decode().split(":")[2]
        prompt_keys = [
            store_key(namespace, h) for h in block_hashes(prompt, 16, namespace, b"", True)
        ]
        originals = dict(zip(prompt_keys, client.mget(prompt_keys), strict=True))
        assert len(originals) == 10 and all(genuine(key, v) for v in originals.values())

        # the attacker: write access to the store, no key. Block 0 becomes an unkeyed value
        # (a codec without a key would take it), the others alternate with keyed-looking ones
        first = prompt_keys[0].encode()
        for i, name in enumerate([first, *(n for n in names if n != first)]):
            client.set(name, forge(client.get(name), keep_mac=i % 2 == 1))
        assert not any(genuine(key, v) for v in client.mget(names))

        logs = tmp_path / "run2"
        logs.mkdir()
        answer, (p, d), prefill_log, _ = serve_once(
            str(embedded_dir), server.url, logs, key_file, prompt
        )
        assert answer == unforged
        # prefill read block 0 first: refused, deleted, counted; all 150 tokens computed and
        # every prompt block written again; decode then read genuine blocks only
        assert p.store_corrupt == 1
        assert 'why="no MAC, and this reader has a key"' in prefill_log
        assert (d.store_corrupt, d.recomputed_tokens) == (0, 0) and d.store_hits == 10
        rewritten = client.mget(prompt_keys)
        for name, value in zip(prompt_keys, rewritten, strict=True):  # recomputed, rewritten
            assert genuine(key, value), name
            again, before = payload(value), payload(originals[name])
            assert again.any() and np.allclose(again, before, rtol=1e-4, atol=1e-4), name
        client.close()
    finally:
        server.stop()
