"""Size caps of the stores that have one: least recently used values go first."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvstore import open_store

NS = "2" * 32


@pytest.mark.parametrize("scheme", ["memory", "local"])
def test_cap_evicts_least_recently_used(scheme, tmp_path):
    url = "memory://" if scheme == "memory" else f"local://{tmp_path}"

    async def scenario():
        store = open_store(url, NS, max_bytes=50_000)
        keys = [i.to_bytes(32, "little") for i in range(16)]
        await store.put_many([(k, os.urandom(5_000)) for k in keys[:8]])  # 40 KB: all fit
        assert await store.longest_prefix(keys[:8]) == 8
        await store.get_many([keys[0]])  # key 0 is now the most recently used
        for k in keys[8:]:  # 40 KB more, one at a time
            await store.put_many([(k, os.urandom(5_000))])
        present = [v is not None for v in await store.get_many(keys)]
        assert present[0], "recently read, kept"
        assert not present[1], "least recently used, evicted"
        assert all(present[12:]), "the newest are kept"
        assert sum(present) * 5_000 <= 50_000
        assert store.stats().evicted >= 6
        await store.close()

    asyncio.run(scenario())
