"""KV blocks in and out of a store: the codec on top of a byte store.

`BlockStore.get` is where untrusted values are checked: a value that fails the codec's checks
is a miss, deleted from the store and counted, and never reaches a cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.codec import BlockCodec, CodecError, DecodedBlocks
from kvstore.store import KVStore
from services.model.kv_cache import KVCache, gather_blocks

log = logging.getLogger("pdserve.kvstore")


@dataclass(frozen=True)
class Fetched:
    """Blocks read back: the first `count` of the hashes asked for, decoded."""

    count: int
    blocks: DecodedBlocks | None  # None when count == 0


class BlockStore:
    def __init__(self, store: KVStore, codec: BlockCodec) -> None:
        self.store = store
        self.codec = codec

    async def put(
        self,
        cache: KVCache,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        """Write cache blocks under their hashes (full blocks unless `num_tokens` says)."""
        if not block_ids:
            return
        k, v = gather_blocks(cache, list(block_ids))
        counts = num_tokens or [self.codec.layout.block_size] * len(block_ids)
        values = self.codec.encode_many(k, v, hashes, counts)
        await self.store.put_many(list(zip(hashes, values, strict=True)))

    async def get_checked(self, hashes: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """(value, token count) of the longest run of leading blocks that are present and
        valid. An invalid value is deleted, counted, and ends the run like a missing one."""
        values = await self.store.get_many(hashes)
        good: list[tuple[bytes, int]] = []
        for h, value in zip(hashes, values, strict=True):
            if value is None:
                break
            try:
                count = self.codec.check(value, h)
            except CodecError as e:
                self.store.stats().corrupt += 1
                log.warning(
                    "corrupt block deleted",
                    extra={"fields": {"hash": h.hex()[:16], "why": e.reason}},
                )
                await self.store.delete([h])
                break
            good.append((value, count))
        return good

    async def get_prefix(self, hashes: Sequence[bytes], dtype: torch.dtype) -> Fetched:
        """`get_checked`, decoded into tensors of `dtype`."""
        good = await self.get_checked(hashes)
        if not good:
            return Fetched(0, None)
        values, counts = [v for v, _ in good], [c for _, c in good]
        return Fetched(len(good), self.codec.decode_checked(values, counts, dtype))


@dataclass(frozen=True)
class StoredBlocks:
    """Checked store values as a KVSource: decoded straight into cache blocks, no staging."""

    codec: BlockCodec
    values: list[bytes]

    def write(self, cache: KVCache, items: list[tuple[int, int]]) -> None:
        for i, block_id in items:
            self.codec.decode_into(self.values[i], cache.k[:, block_id], cache.v[:, block_id])
