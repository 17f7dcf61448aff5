"""A worker's chunks in the KV store: approximate reuse's chunks (services/engine/chunk_reuse.py)
shared by every worker of a deployment, and kept across restarts, as blocks are.

- Out: each chunk the engine keeps (`ChunkReuse.sink`, on the engine's thread: the chunk's
  tensors are copies already) is encoded and written by the worker's event loop, unless the
  store holds it already (another worker computed it first).
- In: before a request that reuses approximately goes to the engine, the chunks it marks past
  the prefix it brings, and that the engine's chunk cache lacks, are read in one call and
  checked (kvstore/chunks.py: every header byte, the checksum, the deployment's MAC); they go
  with the request (`EngineRequest.found_chunks`) into the chunk cache. The engine thread
  never waits on the store.

A store down, a value refused (deleted), a chunk never stored: the chunk is computed, as if it
had never been seen. Refused values and store failures are counted (Load) and logged; after a
failure the store is left alone for STORE_RETRY seconds (a blackholed link would otherwise
cost every request a timeout).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore import open_store
from kvstore.chunks import ChunkCodec, StoredChunk, chunks_namespace
from kvstore.codec import CodecError, StorageDtype
from kvstore.keyfile import read_key
from kvstore.store import KVStore, StoreUnavailable
from services.engine.chunk_reuse import ChunkReuse, chunk_key
from services.engine.params import ValidationError
from services.model.kv_cache import KVCache
from services.rpc import worker_pb2 as pb
from services.settings import StoreSettings
from services.worker import convert

log = logging.getLogger("pdserve.worker")
STORE_RETRY = 2.0  # seconds no read is tried after the store failed one (as kv_link.py)


@dataclass
class ChunkCounters:
    chunks_stored: int = 0  # chunks this worker wrote to the store
    chunks_from_store: int = 0  # chunks read from it for requests (computed elsewhere or before)
    chunks_refused: int = 0  # values the codec refused (deleted; the chunk computed)
    chunks_unavailable: int = 0  # reads or writes the store failed (or, down, not tried)


class ChunkLink:
    """Owned by the worker: `save` runs on the engine's thread, the rest on the event loop."""

    def __init__(
        self,
        reuse: ChunkReuse,
        cache: KVCache,
        kv_namespace: str,
        settings: StoreSettings,
        max_position: int,
    ) -> None:
        self.reuse = reuse
        dtype = StorageDtype.parse(str(cache.dtype).removeprefix("torch."))
        k, v = cache.layer(0)  # K [blocks, heads, D, bs], V [blocks, heads, bs, Dv]
        shape = (reuse.model.config.num_layers, int(k.shape[1]), int(k.shape[2]), int(v.shape[3]))
        key = read_key(settings.kv_key_file) if settings.kv_key_file else None
        namespace = chunks_namespace(kv_namespace, dtype.name.lower())
        self.codec = ChunkCodec(namespace, dtype, shape, max_position, key)
        self.device = cache.device
        self.store: KVStore = open_store(
            settings.kv_store,
            namespace,
            timeout=settings.store_timeout,
            max_bytes=settings.max_bytes,
        )
        self.counters = ChunkCounters()
        self.writing: set[concurrent.futures.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down_until = 0.0  # time.monotonic() before which no read is tried

    @classmethod
    def of(
        cls, reuse: ChunkReuse, cache: KVCache, kv_namespace: str, settings: StoreSettings,
        max_position: int,
    ) -> ChunkLink | None:  # fmt: skip
        """The link, where the model reuses approximately and its cache's dtype is one chunks
        are stored in (not fp8); else None (chunks stay in the worker's own cache)."""
        if reuse.rotation is None:
            return None
        try:
            return cls(reuse, cache, kv_namespace, settings, max_position)
        except ValueError as e:
            log.warning("chunks not shared through the store", extra={"fields": {"why": str(e)}})
            return None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that writes chunks; from here on every chunk kept is stored."""
        self._loop = loop
        self.reuse.sink = self.save

    # -- out ------------------------------------------------------------------------------

    def save(self, key: bytes, kv: StoredChunk) -> None:
        """A chunk the engine kept (its thread): written by the event loop."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._write(key, kv), self._loop)
        self.writing.add(future)
        future.add_done_callback(self.writing.discard)

    async def _write(self, key: bytes, kv: StoredChunk) -> None:
        if time.monotonic() < self._down_until:  # failed a moment ago: not tried again yet
            self.counters.chunks_unavailable += 1
            return
        try:
            if await self.store.longest_prefix([key]):
                return  # another worker's (or this one's before a restart)
            value = await asyncio.to_thread(self.codec.encode, kv, key)
            await self.store.put_many([(key, value)])
            self.counters.chunks_stored += 1
        except StoreUnavailable as e:
            self.counters.chunks_unavailable += 1
            self._down_until = time.monotonic() + STORE_RETRY
            log.warning("chunk not stored", extra={"fields": {"why": str(e)}})

    async def flush(self, timeout: float) -> None:
        """Until every write begun is done (at most `timeout` seconds)."""
        if self.writing:
            futures = [asyncio.wrap_future(f) for f in list(self.writing)]
            await asyncio.wait(futures, timeout=timeout)

    # -- in -------------------------------------------------------------------------------

    async def find(
        self,
        request_id: str,
        prompt: Sequence[int],
        salt: bytes,
        kv_reuse: str | None,
        chunks: tuple[tuple[int, int], ...],
        past: int,
    ) -> tuple[tuple[bytes, StoredChunk], ...]:
        """The chunks of a request that the store holds and the engine's chunk cache lacks
        (past its first `past` tokens, had otherwise); none where the request reuses exactly
        (or may not choose: the engine refuses it) or the store fails."""
        try:
            if not chunks or not self.reuse.validate(kv_reuse):
                return ()
        except ValidationError:
            return ()
        held = self.reuse.cache.entries  # the engine thread's: a lookup is a snapshot
        wanted: dict[bytes, int] = {}
        for start, end in self.reuse.wanted(len(prompt), chunks, past):
            key = chunk_key(list(prompt[start:end]), self.reuse.namespace, salt)
            if key not in held:
                wanted[key] = end - start
        if not wanted or time.monotonic() < self._down_until:
            return ()
        try:
            values = await self.store.get_many(list(wanted))
        except StoreUnavailable as e:
            self.counters.chunks_unavailable += 1
            self._down_until = time.monotonic() + STORE_RETRY
            log.warning(
                "store unavailable, chunks computed",
                extra={"fields": {"request_id": request_id, "why": str(e)}},
            )
            return ()
        found = []
        for (key, tokens), value in zip(wanted.items(), values, strict=True):
            if value is None:
                continue
            chunk = await self._decode(request_id, key, tokens, value)
            if chunk is not None:
                found.append((key, chunk))
        self.counters.chunks_from_store += len(found)
        return tuple(found)

    async def _decode(
        self, request_id: str, key: bytes, tokens: int, value: bytes
    ) -> StoredChunk | None:
        try:
            chunk = await asyncio.to_thread(self.codec.decode, value, key, tokens)
        except CodecError as e:
            self.counters.chunks_refused += 1
            log.warning(
                "chunk refused",
                extra={"fields": {"request_id": request_id, "why": e.reason}},
            )
            with contextlib.suppress(StoreUnavailable):
                await self.store.delete([key])
            return None
        return StoredChunk(chunk.was, chunk.keys.to(self.device), chunk.values.to(self.device))

    async def close(self) -> None:
        await self.store.close()


async def reuse_fields(
    link: ChunkLink | None,
    rid: str,
    prompt: Sequence[int],
    request: pb.PrefillRequest | pb.DecodeRequest,
    past: int,
) -> dict[str, Any]:
    """A Prefill's or Decode's KV reuse as EngineRequest's fields, with the chunks it marks
    past its first `past` tokens (had otherwise) that the store holds and the engine lacks."""
    fields = convert.reuse(request)
    if link is not None and fields["chunks"]:
        fields["found_chunks"] = await link.find(
            rid, prompt, request.salt, fields["kv_reuse"], fields["chunks"], past
        )
    return fields
