"""A worker's image rows (services/worker/images.py) over a real store: encoded once however
many requests ask for an image at the same time; found in the store by another worker's
source (no encoding there); a value damaged or planted under another image's digest refused,
deleted and encoded again; a bad file is the request's ValidationError."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.keyfile import make_key
from services.engine.params import ValidationError
from services.model.loader import load_encoder
from services.settings import DEFAULTS
from services.worker.images import ImageSource
from tests.support.tiny_vision import picture, save_tiny_gemma3_vision


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("gemma3-vision")
    save_tiny_gemma3_vision(path, embedded_dir)
    return path


def source(checkpoint, store_dir, key) -> ImageSource:
    """A fresh worker's source: its own encoder (nothing cached), the shared local:// store."""
    encoder, _, _ = load_encoder(str(checkpoint), "float32", "cpu")
    store = DEFAULTS.store.__class__(**{**DEFAULTS.store.__dict__,
                                        "kv_store": f"local://{store_dir}",
                                        "kv_key_file": str(key)})  # fmt: skip
    return ImageSource(encoder, "ab" * 16, torch.float32, store)


def test_one_encoding_however_many_ask_and_the_next_worker_reads_it(checkpoint, tmp_path):
    key = make_key(tmp_path / "kv.key")
    data = picture(1, (24, 36))

    async def run() -> None:
        first = source(checkpoint, tmp_path / "kv", key)
        rows = await asyncio.gather(*(first.get(first.encoder.digest(data), data)
                                      for _ in range(4)))  # fmt: skip
        assert first.counters.encoded == 1
        assert all(torch.equal(r, rows[0]) for r in rows)
        second = source(checkpoint, tmp_path / "kv", key)
        again = await second.get(second.encoder.digest(data), data)
        assert (second.counters.encoded, second.counters.store_hits) == (0, 1)
        assert torch.equal(again, rows[0])
        await first.close()
        await second.close()

    asyncio.run(run())


def test_rows_planted_under_another_image_are_refused_and_encoded(checkpoint, tmp_path):
    """The store's writer copies image A's value under image B's key: the codec checks the
    digest it asked for, so B's rows are B's."""
    key = make_key(tmp_path / "kv.key")
    a, b = picture(2, (24, 36)), picture(3, (24, 36))

    async def run() -> None:
        writer = source(checkpoint, tmp_path / "kv", key)
        da, db = writer.encoder.digest(a), writer.encoder.digest(b)
        rows_a = await writer.get(da, a)
        (value,) = await writer.store.get_many([da])
        await writer.store.put_many([(db, value)])
        reader = source(checkpoint, tmp_path / "kv", key)
        rows_b = await reader.get(db, b)
        assert (reader.counters.store_refused, reader.counters.encoded) == (1, 1)
        assert not torch.equal(rows_b, rows_a)
        with pytest.raises(ValidationError, match="not an image"):
            await reader.get(b"\0" * 32, b"no image here")
        await writer.close()
        await reader.close()

    asyncio.run(run())


def test_rows_an_encoder_is_making_are_awaited_in_the_store_then_encoded_here(checkpoint, tmp_path):
    """Told to wait (an encoder is making the rows): rows that reach the store 0.3 s later
    are read there, not encoded; rows that never come are encoded here once the wait is
    over, not before."""
    key = make_key(tmp_path / "kv.key")
    slow, never = picture(4, (24, 36)), picture(5, (24, 36))

    async def run() -> None:
        encoder, worker = (
            source(checkpoint, tmp_path / "kv", key),
            source(checkpoint, tmp_path / "kv", key),
        )

        async def encode_later() -> None:
            await asyncio.sleep(0.3)
            assert await encoder.publish(slow)

        later = asyncio.ensure_future(encode_later())
        rows = await worker.get(worker.encoder.digest(slow), slow, wait=30)
        await later
        assert (worker.counters.encoded, worker.counters.store_hits) == (0, 1)
        assert worker.counters.waited == 1
        assert torch.equal(rows, encoder.encoder.cached(encoder.encoder.digest(slow)))
        loop = asyncio.get_running_loop()
        began = loop.time()
        await worker.get(worker.encoder.digest(never), never, wait=0.4)
        assert loop.time() - began >= 0.4
        assert (worker.counters.encoded, worker.counters.waited) == (1, 2)
        await encoder.close()
        await worker.close()

    asyncio.run(run())
