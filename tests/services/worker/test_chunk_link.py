"""Approximate reuse's chunks in a real Redis (services/worker/chunk_link.py), between workers
that share nothing else:

- a worker's chunks, once its engine keeps them, are in the store (one value each, written
  once however often they are kept again); another worker's engine, which never saw them,
  reads them for a prompt that moved them and places them: byte-identical K/V, and the same
  tokens and logprobs as the first worker's engine gets for that prompt (in every dtype the
  CPU runs);
- faults (docs/design.md's table): a value damaged in the store, or one made with another
  deployment's key (forged), is refused, counted and deleted, and its chunk computed; a store
  that is down costs the request nothing but the chunks: computed, as exactly as without.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kvstore.chunks import ChunkCodec, StoredChunk
from kvstore.keyfile import make_key
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest, Sequence
from services.model.loader import LoadedModel, load_model
from services.settings import DEFAULTS, ReuseConfig
from services.worker.chunk_link import ChunkLink
from tests.services.engine.test_chunk_reuse import TEXTS  # the same notes
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.redis_servers import free_port

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
NAMESPACE = "cd" * 16


@pytest.fixture(scope="module", params=COMPUTE_DTYPES)
def model(request, embedded, embedded_dir) -> LoadedModel:
    if request.param == "float32":
        return embedded
    return load_model(str(embedded_dir), dtype=request.param, device="cpu")


def prompt(model: LoadedModel, *names: str) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """The texts' tokens joined; the documents (first, second) marked as chunks."""
    ids: list[int] = []
    chunks = []
    for name in names:
        part = model.tokenizer.encode(TEXTS[name], add_special_tokens=False)
        if name in ("first", "second"):
            chunks.append((len(ids), len(ids) + len(part)))
        ids += part
    return ids, tuple(chunks)


def computed(model: LoadedModel, ids: list[int]) -> tuple[list[int], list]:
    """The prompt's tokens and logprobs computed by an engine reusing nothing."""
    engine = Engine(model.model, model.tokenizer, EngineConfig(num_blocks=64))
    engine.add_request(EngineRequest("cold", ids, GREEDY))
    seq = engine.requests["cold"].seqs[0]
    while engine.has_unfinished:
        engine.step()
    return seq.output_ids, seq.logprobs


class Worker:
    """What a worker holds of this: an engine reusing approximately and its link."""

    def __init__(self, model: LoadedModel, url: str, key_file=None, timeout=1.0) -> None:
        config = EngineConfig(num_blocks=64, reuse=ReuseConfig(kv_reuse="approximate"))
        self.engine = Engine(model.model, model.tokenizer, config, namespace=NAMESPACE)
        store = dataclasses.replace(
            DEFAULTS.store, kv_store=url, kv_key_file=key_file, store_timeout=timeout
        )
        link = ChunkLink.of(self.engine.reuse, self.engine.runner.kv, NAMESPACE, store, 2048)
        assert link is not None
        self.link = link
        link.start(asyncio.get_running_loop())

    async def run(self, rid: str, ids: list[int], chunks) -> Sequence:
        """The request as a worker takes it: its chunks read first, then computed."""
        found = await self.link.find(rid, ids, b"", None, chunks, 0)
        request = EngineRequest(rid, ids, GREEDY, chunks=chunks, found_chunks=found)
        self.engine.add_request(request)
        seq = self.engine.requests[rid].seqs[0]
        while self.engine.has_unfinished:
            self.engine.step()
        await self.link.flush(10)  # the chunks it kept reach the store
        return seq


def test_a_worker_places_the_chunks_another_stored(model, redis_server):
    first, first_chunks = prompt(model, "head", "first", "second", "question")
    moved, moved_chunks = prompt(model, "other", "second", "first", "question")
    placed = sum(e - s for s, e in moved_chunks)

    async def go() -> None:
        a = Worker(model, redis_server.url)
        await a.run("first", first, first_chunks)
        assert a.link.counters.chunks_stored == 2
        await a.run("first-again", first, first_chunks)  # kept already: not written again
        assert a.link.counters.chunks_stored == 2
        own = await a.run("moved", moved, moved_chunks)  # from its own chunk cache
        assert (own.num_reused_tokens, a.link.counters.chunks_from_store) == (placed, 0)

        b = Worker(model, redis_server.url)  # a fresh worker: its chunk cache is empty
        seq = await b.run("moved", moved, moved_chunks)
        assert b.link.counters.chunks_from_store == 2
        assert seq.num_reused_tokens == placed
        assert (seq.output_ids, seq.logprobs) == (own.output_ids, own.logprobs)
        for key, kv in b.engine.reuse.cache.entries.items():  # byte for byte what A kept
            theirs = a.engine.reuse.cache.entries[key]
            assert kv.was == theirs.was
            assert torch.equal(kv.keys, theirs.keys) and torch.equal(kv.values, theirs.values)
        assert b.link.counters.chunks_stored == 0  # placed chunks are not kept again
        await a.link.close()
        await b.link.close()

    asyncio.run(go())


def test_damaged_or_forged_chunks_are_refused_and_computed(embedded, redis_server, tmp_path):
    key_file = make_key(tmp_path / "kv.key")
    first, first_chunks = prompt(embedded, "head", "first", "second", "question")
    moved, moved_chunks = prompt(embedded, "other", "second", "first", "question")

    async def go() -> None:
        a = Worker(embedded, redis_server.url, key_file)
        await a.run("first", first, first_chunks)
        keys = list(a.engine.reuse.cache.entries)
        damaged, forged = keys
        (value,) = await a.link.store.get_many([damaged])
        flipped = bytearray(value)
        flipped[200] ^= 1  # a payload byte
        kv = a.engine.reuse.cache.entries[forged]
        other_key = make_key(tmp_path / "other.key").read_bytes()
        codec = a.link.codec
        shape = (codec.layers, codec.heads, codec.k_dim, codec.v_dim)
        intruder = ChunkCodec(NAMESPACE, codec.dtype, shape, 2048, other_key)
        planted = intruder.encode(StoredChunk(kv.was, kv.keys, kv.values), forged)
        await a.link.store.put_many([(damaged, bytes(flipped)), (forged, planted)])

        b = Worker(embedded, redis_server.url, key_file)
        assert await b.link.find("moved", moved, b"", None, moved_chunks, 0) == ()
        assert (b.link.counters.chunks_refused, b.link.counters.chunks_from_store) == (2, 0)
        assert await b.link.store.get_many(keys) == [None, None]  # deleted
        seq = await b.run("moved", moved, moved_chunks)
        assert seq.num_reused_tokens == 0  # both computed: the prompt exactly
        assert b.link.counters.chunks_stored == 2  # and stored again, whole
        assert (seq.output_ids, seq.logprobs) == computed(embedded, moved)
        for w in (a, b):
            await w.link.close()

    asyncio.run(go())


def test_a_store_down_costs_only_the_chunks(embedded):
    first, first_chunks = prompt(embedded, "head", "first", "second", "question")
    moved, moved_chunks = prompt(embedded, "other", "second", "first", "question")
    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    async def go() -> None:
        a = Worker(embedded, down, timeout=0.5)
        await a.run("first", first, first_chunks)  # kept here: the read failed, no writes
        assert len(a.engine.reuse.cache.entries) == 2
        assert a.link.counters.chunks_unavailable == 1 + 2  # the read, both writes not tried
        assert a.link.counters.chunks_stored == 0
        b = Worker(embedded, down, timeout=0.5)
        seq = await b.run("moved", moved, moved_chunks)  # the read failed: computed
        assert b.link.counters.chunks_unavailable == 1 + 2
        assert (seq.num_reused_tokens, b.link.counters.chunks_from_store) == (0, 0)
        assert (seq.output_ids, seq.logprobs) == computed(embedded, moved)
        for w in (a, b):
            await w.link.close()

    asyncio.run(go())
