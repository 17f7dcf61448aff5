"""KV blocks in shared stores: keys, the block codec, and the backends behind one interface.

`open_store(url, namespace)` picks a backend by the URL's scheme (kvstore/store.py has the
interface they implement). This package imports nothing from the services built on it.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvstore.store import KVStore

DEFAULT_TIMEOUT = 1.0


def open_store(
    url: str,
    namespace: str,
    timeout: float = DEFAULT_TIMEOUT,
    ttl: int | None = None,
    max_bytes: int | None = None,
    max_connections: int = 16,
) -> KVStore:
    """A store for `url`:
    memory://                          in this process (tests, single-process use)
    local://PATH                       files under PATH, shared by the processes of one host
    redis://[user:pass@]host:port/db   Redis (rediss:// for TLS, unix:///path.sock); a user is
                                       an ACL user, a password alone is the default user's;
                                       TLS options in the query: ?ssl_ca_certs=CA&ssl_certfile=
                                       CERT&ssl_keyfile=KEY (client certificates)
    redis+cluster://host:port          Redis Cluster (any node; the others are discovered)
    `ttl` (seconds) expires Redis values; `max_bytes` caps memory:// and local:// (LRU)."""
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        from kvstore.memory import MemoryStore

        return MemoryStore(namespace, timeout, max_bytes)
    if scheme == "local":
        from kvstore.local import LocalStore

        return LocalStore(url, namespace, timeout, max_bytes)
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        from kvstore.redis_store import RedisStore

        return RedisStore(url, namespace, timeout, ttl, max_connections)
    raise ValueError(
        f"unknown KV store URL {url!r}: use memory://, local://PATH, redis://, rediss://, "
        "unix:// or redis+cluster://"
    )
