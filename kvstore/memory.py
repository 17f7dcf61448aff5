"""memory:// — a store inside this process: tests and single-process use."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvstore.store import Backend, Value


class MemoryStore(Backend):
    def __init__(self, namespace: str, timeout: float, max_bytes: int | None = None) -> None:
        super().__init__(namespace, timeout)
        self.max_bytes = max_bytes
        self._values: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self._bytes = 0

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        for h, value in items:
            old = self._values.pop(h, None)
            self._bytes -= len(old) if old is not None else 0
            self._values[h] = bytes(value)
            self._bytes += len(value)
        self.count_put(items)
        self._evict()

    async def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        out = []
        for h in hashes:
            value = self._values.get(h)
            if value is not None:
                self._values.move_to_end(h)
            out.append(value)
        self.count_get(out)
        return out

    async def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self._values:
            n += 1
        return n

    async def delete(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            old = self._values.pop(h, None)
            self._bytes -= len(old) if old is not None else 0

    async def close(self) -> None:
        self._values.clear()
        self._bytes = 0

    def _evict(self) -> None:
        while self.max_bytes is not None and self._bytes > self.max_bytes and self._values:
            _, old = self._values.popitem(last=False)
            self._bytes -= len(old)
            self._stats.evicted += 1
