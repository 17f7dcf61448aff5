"""The store interface every backend implements (`open_store` in kvstore/__init__.py picks one
by URL).

A store holds byte values under block hashes, in one namespace (a KV layout). Contract:
- `get_many` gives None for a key that is absent (never written, evicted, deleted); absence is
  never an error.
- Every call either completes within the store's timeout or raises `StoreUnavailable`; no call
  blocks longer (a dead or slow store must never hang a request).
- `put_many` may have written some values when it raises: readers validate every value they
  get (kvstore/codec.py), so a partial write is at worst a miss.
- `longest_prefix(hashes)`: how many leading hashes are present, in one round trip. A key it
  counted may be gone by the time it is read; `get_many` then reports it missing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

from kvstore.keys import store_key

Value = bytes | bytearray | memoryview


class StoreUnavailable(Exception):
    """The store could not be reached, or did not answer within the timeout."""


@dataclass
class StoreStats:
    puts: int = 0  # blocks written
    gets: int = 0  # blocks asked for
    hits: int = 0  # ... and found
    corrupt: int = 0  # found but invalid: deleted, counted as misses (see blocks.py)
    bytes_written: int = 0
    bytes_read: int = 0
    unavailable: int = 0  # calls that raised StoreUnavailable
    evicted: int = 0  # by this process's size cap (local://, memory://)

    @property
    def misses(self) -> int:
        return self.gets - self.hits + self.corrupt


class KVStore(Protocol):
    namespace: str

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None: ...

    async def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]: ...

    async def longest_prefix(self, hashes: Sequence[bytes]) -> int: ...

    async def delete(self, hashes: Sequence[bytes]) -> None: ...

    def stats(self) -> StoreStats: ...

    async def close(self) -> None: ...


class Backend:
    """What the backends share: keys, stats, and the timeout around every call."""

    def __init__(self, namespace: str, timeout: float) -> None:
        self.namespace = namespace
        self.timeout = timeout
        self._stats = StoreStats()

    def key(self, block_hash: bytes) -> str:
        return store_key(self.namespace, block_hash)

    def stats(self) -> StoreStats:
        return self._stats

    @contextlib.asynccontextmanager
    async def guarded(
        self, what: str, errors: tuple[type[BaseException], ...] = ()
    ) -> AsyncIterator[None]:
        """Bound the body by the timeout; turn timeouts, connection errors and the backend's
        own `errors` into StoreUnavailable."""
        caught: tuple[type[BaseException], ...] = (TimeoutError, OSError, *errors)
        try:
            async with asyncio.timeout(self.timeout):
                yield
        except caught as e:
            self._stats.unavailable += 1
            raise StoreUnavailable(f"{what}: {type(e).__name__}: {e}") from e

    def count_put(self, items: Sequence[tuple[bytes, Value]]) -> None:
        self._stats.puts += len(items)
        self._stats.bytes_written += sum(len(v) for _, v in items)

    def count_get(self, values: Sequence[bytes | None]) -> None:
        found = [v for v in values if v is not None]
        self._stats.gets += len(values)
        self._stats.hits += len(found)
        self._stats.bytes_read += sum(len(v) for v in found)


def redact(url: str) -> str:
    """`url` with its password, if it has one, as *** (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
