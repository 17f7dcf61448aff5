"""KV blocks in and out of a store: the codec on top of a byte store.

`BlockStore.get` is where untrusted values are checked: a value that fails the codec's checks
is a miss, deleted from the store and counted, and never reaches a cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.codec import BlockCodec, CodecError, DecodedBlocks
from kvstore.store import KVStore, Value

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

    def encode(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        hashes: Sequence[bytes],
        num_tokens: Sequence[int] | None = None,
    ) -> list[tuple[bytes, Value]]:
        """(hash, value) of each block: K [n, L, kv_heads, D, bs], V [n, L, kv_heads, bs, D]
        (full blocks unless `num_tokens` says), ready for the store's put_many."""
        counts = num_tokens or [self.codec.layout.block_size] * len(hashes)
        values = self.codec.encode_many(k, v, hashes, counts)
        return list(zip(hashes, values, strict=True))

    async def put(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        hashes: Sequence[bytes],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        """Write blocks (shaped as `encode` takes them) under their hashes."""
        if hashes:
            await self.store.put_many(self.encode(k, v, hashes, num_tokens))

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


class PagedKV(Protocol):
    """A paged KV pool (services/model/kv_cache.py's KVCache). `plain`: the pool indexed in
    the layout blocks are stored in, K [layers, blocks, kv_heads, D / 2, 2, bs], V [layers,
    blocks, kv_heads, bs / 2, 2, D] (views: a dimension of K, a token of V, split in two),
    where the pool holds every block whole in one place; None where its parts lie in several
    pools: a block is then written through `write_blocks`."""

    @property
    def plain(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def block_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]: ...

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class StoredBlocks:
    """Checked store values as a KVSource: decoded straight into a CPU pool's blocks, no
    staging; for a GPU pool (or one in several parts), staged in one host buffer and copied
    once (write_staged)."""

    codec: BlockCodec
    values: list[bytes]

    def write(self, cache: PagedKV, items: list[tuple[int, int]]) -> None:
        plain = cache.plain
        if cache.device.type != "cpu" or plain is None:
            self.write_staged(cache, items)
            return
        k_plain, v_plain = plain
        for i, block_id in items:
            self.codec.decode_into(self.values[i], k_plain[:, block_id], v_plain[:, block_id])

    def write_staged(self, cache: PagedKV, items: list[tuple[int, int]]) -> None:
        """The same, decoded into one host buffer (pinned for a CUDA pool), then copied to the
        pool's device once for K and once for V and scattered there into the blocks."""
        if not items:
            return
        pinned = cache.device.type == "cuda"
        k_shape, v_shape = cache.block_shapes()
        dtype = cache.dtype
        k = torch.empty((len(items), *k_shape), dtype=dtype, pin_memory=pinned)
        v = torch.empty((len(items), *v_shape), dtype=dtype, pin_memory=pinned)
        for j, (i, _) in enumerate(items):
            self.codec.decode_into(self.values[i], k[j], v[j])
        cache.write_blocks([b for _, b in items], k, v)
