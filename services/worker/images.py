"""A request's images on a worker: checked, named and encoded here, never taken on a caller's
word. The worker finds the prompt's image places itself (runs of the model's image token),
names each image by the digest of its bytes and the model's preprocessing (the block hashes
include them), and gets its rows: from its encoder's own cache, from the store (an encode
worker, or another worker, put them there: kvstore/embeddings.py), or by encoding it here,
in a thread of its own (the engine thread keeps stepping the batch meanwhile), then putting
them in the store for the others. A store down or a value refused costs only the encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore import open_store
from kvstore.block_hash import ImageSpan
from kvstore.codec import CodecError, StorageDtype
from kvstore.embeddings import EmbeddingCodec, embeddings_namespace
from kvstore.keyfile import read_key
from kvstore.store import KVStore, StoreUnavailable
from services.engine.images import PromptImage, spans_of_files
from services.engine.params import ValidationError
from services.model.vision.encoder import ImageEncoder
from services.model.vision.images import ImageError
from services.settings import StoreSettings

log = logging.getLogger("pdserve.worker")
POLL = 0.02  # seconds between reads of the store for rows an encoder is making


@dataclass
class ImageCounters:
    encoded: int = 0  # images run through the tower here
    local_hits: int = 0  # found in this worker's encoder cache
    store_hits: int = 0  # read from the store
    store_refused: int = 0  # values the codec refused (deleted, encoded again)
    waited: int = 0  # images whose rows were awaited in the store (an encoder making them)


class ImageSource:
    """Thread-safe where the encoder is; its methods run on the worker's event loop."""

    def __init__(
        self, encoder: ImageEncoder, kv_namespace: str, dtype: torch.dtype, store: StoreSettings
    ) -> None:
        self.encoder = encoder
        vision = encoder.vision
        storage = StorageDtype.parse(str(dtype).removeprefix("torch."))
        self.namespace = embeddings_namespace(
            kv_namespace, storage.name.lower(), vision.preprocess.settings
        )
        key = read_key(store.kv_key_file) if store.kv_key_file else None
        width = encoder.width
        self.codec = EmbeddingCodec(self.namespace, storage, vision.tokens_per_image, width, key)
        self.store: KVStore = open_store(
            store.kv_store, self.namespace, timeout=store.store_timeout, max_bytes=store.max_bytes
        )
        self.counters = ImageCounters()
        # images being encoded here now: a second request for one waits for its rows
        self._encoding: dict[bytes, asyncio.Future[torch.Tensor]] = {}

    def spans(self, prompt: Sequence[int], files: Sequence[bytes]) -> tuple[ImageSpan, ...]:
        return spans_of_files(prompt, self.encoder.vision, files)

    def at_hand(self, spans: Sequence[ImageSpan]) -> tuple[PromptImage, ...]:
        """Each image with the rows this worker's cache holds (None where it holds none)."""
        return tuple(PromptImage(span, self.encoder.cached(span.digest)) for span in spans)

    async def rows(
        self,
        spans: Sequence[ImageSpan],
        files: Sequence[bytes],
        waits: Sequence[float] | None = None,
    ) -> tuple[PromptImage, ...]:
        """Each image's rows beside its span; ValidationError("images") for a bad file.
        `waits`: seconds to wait for each image's rows in the store (an encoder is making
        them) before encoding it here."""
        waits = waits or [0.0] * len(spans)
        each = zip(spans, files, waits, strict=True)
        got = await asyncio.gather(
            *(self.get(span.digest, data, wait) for span, data, wait in each)
        )
        return tuple(PromptImage(span, rows) for span, rows in zip(spans, got, strict=True))

    async def get(self, digest: bytes, data: bytes, wait: float = 0.0) -> torch.Tensor:
        """The image's rows: this worker's cache, the store's (waiting up to `wait` seconds
        for them to come), or encoded here (and stored)."""
        found = self.encoder.cached(digest)
        if found is not None:
            self.counters.local_hits += 1
            return found
        if digest in self._encoding:
            return await asyncio.shield(self._encoding[digest])
        stored = await self._read(digest)
        if stored is None and wait > 0:
            stored = await self._await_stored(digest, wait)
            self.counters.waited += 1
        if stored is not None:
            self.counters.store_hits += 1
            return self.encoder.remember(digest, stored.to(self.encoder.device))
        try:
            return await self._encode_once(digest, data)
        except ImageError as e:
            raise ValidationError("images", str(e)) from None

    async def _await_stored(self, digest: bytes, wait: float) -> torch.Tensor | None:
        """The rows once the store has them, read every POLL seconds (at first more often)
        for `wait` seconds; None when they did not come (or this worker began encoding it)."""
        deadline = asyncio.get_running_loop().time() + wait
        pause = POLL / 8
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, POLL)
            if digest in self._encoding:
                return None
            stored = await self._read(digest)
            if stored is not None:
                return stored
        return None

    async def _encode_once(self, digest: bytes, data: bytes) -> torch.Tensor:
        """The image encoded here and its rows stored; requests for it meanwhile wait for
        this one (ImageError for a bad file, to each of them)."""
        if digest in self._encoding:
            return await asyncio.shield(self._encoding[digest])
        done: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self._encoding[digest] = done
        try:
            rows = await asyncio.to_thread(self.encoder.encode, data, digest)
            self.counters.encoded += 1
            await self._write(digest, rows)
            done.set_result(rows)
            return rows
        except BaseException as e:
            done.set_exception(e)
            done.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            del self._encoding[digest]

    async def publish(self, data: bytes) -> bool:
        """The image's rows in the store: True when encoded here, False when the store held
        them already (an encode worker's job); ImageError for a bad file."""
        digest = self.encoder.digest(data)
        if digest in self._encoding:
            await asyncio.shield(self._encoding[digest])
            return False
        try:
            if await self.store.longest_prefix([digest]):
                return False
        except StoreUnavailable:
            pass  # encoded all the same: the Encode's caller falls back to its own
        await self._encode_once(digest, data)
        return True

    async def _read(self, digest: bytes) -> torch.Tensor | None:
        try:
            (value,) = await self.store.get_many([digest])
        except StoreUnavailable:
            return None
        if value is None:
            return None
        try:
            return self.codec.decode(value, digest)
        except CodecError as e:
            self.counters.store_refused += 1
            log.warning("image rows refused", extra={"fields": {"why": e.reason}})
            with contextlib.suppress(StoreUnavailable):
                await self.store.delete([digest])
            return None

    async def _write(self, digest: bytes, rows: torch.Tensor) -> None:
        try:
            await self.store.put_many([(digest, self.codec.encode(rows, digest))])
        except StoreUnavailable as e:
            log.warning("image rows not stored", extra={"fields": {"why": str(e)}})

    async def close(self) -> None:
        await self.store.close()
