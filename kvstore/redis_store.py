"""redis:// rediss:// unix:// redis+cluster:// — Redis, standalone or clustered.

redis-py's asyncio client with the hiredis parser, a bounded pool of connections, and every
batch sent as one pipeline (no MULTI: blocks are independent). In a cluster the pipeline is
split by node, one round trip per node. redis-py's own retries are switched off: the store's
timeout is the whole budget, and a dead server must surface as StoreUnavailable, not as a
retry loop.

Access comes from the URL, as redis-py reads it: `redis://:PASSWORD@host` AUTHs as the
default user, `redis://USER:PASSWORD@host` as an ACL user (it needs GET, SET, EXISTS and DEL
on `pdserve:*`), `rediss://` speaks TLS with `ssl_ca_certs`, `ssl_certfile` and `ssl_keyfile`
in the query (tests/kvstore/test_redis_options.py runs each against a real redis-server).
A wrong password or a refused command is a StoreUnavailable like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvstore.store import Backend, Value


class RedisStore(Backend):
    def __init__(
        self, url: str, namespace: str, timeout: float, ttl: int | None, max_connections: int
    ) -> None:
        super().__init__(namespace, timeout)
        self.ttl = ttl
        parts = urlsplit(url)
        options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        self.client: Any
        if parts.scheme.endswith("+cluster"):
            plain = urlunsplit(parts._replace(scheme=parts.scheme.removesuffix("+cluster")))
            self.client = RedisCluster.from_url(plain, max_connections=max_connections, **options)
        else:
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=timeout, **options
            )
            self.client = aioredis.Redis(connection_pool=pool)

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        if not items:
            return
        async with self._call("put"):
            pipe = self.client.pipeline(transaction=False)
            for h, value in items:
                pipe.set(self.key(h), value, ex=self.ttl)
            await pipe.execute()
        self.count_put(items)

    async def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        if not hashes:
            return []
        async with self._call("get"):
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.get(self.key(h))
            values = list(await pipe.execute())
        self.count_get(values)
        return values

    async def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        if not hashes:
            return 0
        async with self._call("exists"):
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            present = await pipe.execute()
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    async def delete(self, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        async with self._call("delete"):
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.delete(self.key(h))
            await pipe.execute()

    async def close(self) -> None:
        await self.client.aclose()

    def _call(self, what: str) -> Any:
        return self.guarded(what, (RedisError,))
