"""Every backend, through the one interface: memory://, local://, a real redis-server and a
real three-node Redis Cluster."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvstore import open_store
from kvstore.block_hash import KVLayout, block_hashes
from kvstore.blocks import BlockStore
from kvstore.codec import BlockCodec, StorageDtype
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache, gather_blocks, scatter_blocks

LAYOUT = KVLayout("model-a", "bfloat16", 16, 2, 3, 64)
NS = LAYOUT.namespace()


@pytest.fixture(params=["memory", "local", "redis", "cluster"])
def store_url(request, tmp_path):
    if request.param == "memory":
        return "memory://"
    if request.param == "local":
        return f"local://{tmp_path}"
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        server.redis_cli("flushall")
        return server.url
    cluster = request.getfixturevalue("redis_cluster")
    for node in cluster.nodes:
        node.redis_cli("flushall")
    return cluster.url


def run(coro):
    return asyncio.run(coro)


def values(n: int, size: int = 5000) -> list[tuple[bytes, bytes]]:
    return [(bytes([i]) * 32, os.urandom(size)) for i in range(n)]


def test_round_trip_missing_and_delete(store_url):
    async def scenario():
        store = open_store(store_url, NS)
        items = values(10)
        await store.put_many(items)
        got = await store.get_many([h for h, _ in items] + [b"\xee" * 32])
        assert got[:10] == [v for _, v in items] and got[10] is None
        await store.delete([items[3][0]])
        assert (await store.get_many([items[3][0]])) == [None]
        stats = store.stats()
        assert (stats.puts, stats.gets, stats.hits) == (10, 12, 10)
        assert stats.bytes_written == 50_000 and stats.bytes_read == 50_000
        await store.close()

    run(scenario())


def test_longest_prefix_stops_at_a_missing_middle_block(store_url):
    async def scenario():
        store = open_store(store_url, NS)
        items = values(8, size=100)
        await store.put_many(items[:3] + items[4:])  # block 3 missing
        hashes = [h for h, _ in items]
        assert await store.longest_prefix(hashes) == 3
        assert await store.longest_prefix(hashes[4:]) == 4
        assert await store.longest_prefix([]) == 0
        await store.close()

    run(scenario())


def test_keys_follow_the_design(redis_server):
    async def scenario():
        store = open_store(redis_server.url, NS)
        await store.put_many([(b"\xab" * 32, b"x")])
        await store.close()

    redis_server.redis_cli("flushall")
    run(scenario())
    keys = redis_server.redis_cli("keys", "*").split()
    assert keys == [f"pdserve:kv:{NS}:{'ab' * 16}"]


def test_cluster_spreads_keys_over_nodes(redis_cluster):
    async def scenario():
        store = open_store(redis_cluster.url, NS)
        await store.put_many(values(60, size=10))
        await store.close()

    for node in redis_cluster.nodes:
        node.redis_cli("flushall")
    run(scenario())
    sizes = [int(node.redis_cli("dbsize")) for node in redis_cluster.nodes]
    assert sum(sizes) == 60 and sum(s > 0 for s in sizes) == 3


def _cache(seed: int) -> KVCache:
    config = ModelConfig("llama", 100, 192, 256, 2, 3, 3, 64, 1e-5, 1e4, 64, True, False)
    cache = KVCache(config, 8, 16, torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def test_blocks_move_between_caches_byte_for_byte(store_url):
    async def scenario():
        codec = BlockCodec(LAYOUT, StorageDtype.BFLOAT16)
        blocks = BlockStore(open_store(store_url, NS), codec)
        source, target = _cache(1), _cache(2)
        hashes = block_hashes(list(range(64)), 16, NS)
        await blocks.put(*gather_blocks(source, [5, 1, 6, 2]), hashes)
        fetched = await blocks.get_prefix(hashes, torch.bfloat16)
        assert fetched.count == 4 and fetched.blocks is not None
        scatter_blocks(target, [0, 3, 4, 7], fetched.blocks.k, fetched.blocks.v)
        for src, dst in zip([5, 1, 6, 2], [0, 3, 4, 7], strict=True):
            assert torch.equal(target.k[:, dst], source.k[:, src])
            assert torch.equal(target.v[:, dst], source.v[:, src])
        await blocks.store.close()

    run(scenario())


def test_corrupt_and_vanished_blocks_are_misses(store_url):
    async def scenario():
        codec = BlockCodec(LAYOUT, StorageDtype.BFLOAT16)
        store = open_store(store_url, NS)
        blocks = BlockStore(store, codec)
        cache = _cache(3)
        hashes = block_hashes(list(range(80)), 16, NS)
        await blocks.put(*gather_blocks(cache, [0, 1, 2, 3, 4]), hashes)
        good = (await store.get_many([hashes[3]]))[0]
        assert good is not None
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF
        await store.put_many([(hashes[3], bytes(bad))])
        fetched = await blocks.get_prefix(hashes, torch.bfloat16)
        assert fetched.count == 3  # stops at the corrupt block
        assert store.stats().corrupt == 1
        assert (await store.get_many([hashes[3]])) == [None]  # deleted
        # counted present, then evicted before the read: a miss, not an error
        assert await store.longest_prefix(hashes) == 3
        await store.delete([hashes[1]])
        assert (await blocks.get_prefix(hashes, torch.bfloat16)).count == 1
        await store.close()

    run(scenario())
