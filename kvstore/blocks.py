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

    async def get_prefix(self, hashes: Sequence[bytes], dtype: torch.dtype) -> Fetched:
        """The longest run of leading blocks that are present and valid. An invalid value is
        deleted, counted, and ends the run like a missing one."""
        values = await self.store.get_many(hashes)
        good: list[bytes] = []
        counts: list[int] = []
        for h, value in zip(hashes, values, strict=True):
            if value is None:
                break
            try:
                counts.append(self.codec.check(value, h))
            except CodecError as e:
                self.store.stats().corrupt += 1
                log.warning(
                    "corrupt block deleted",
                    extra={"fields": {"hash": h.hex()[:16], "why": e.reason}},
                )
                await self.store.delete([h])
                break
            good.append(value)
        if not good:
            return Fetched(0, None)
        return Fetched(len(good), self.codec.decode_checked(good, counts, dtype))
