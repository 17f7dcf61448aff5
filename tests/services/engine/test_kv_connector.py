"""The KV seam in one process: a prefill engine (prefill/connector.py) saves a prompt's
blocks, a second engine (decode/connector.py) loads them and continues; tokens equal one
engine doing it all. The worker half here keeps the blocks in memory (a worker's is the
KV store's link)."""

from __future__ import annotations

import pytest
import torch

from decode.connector import DecodeConnector
from kvstore.block_hash import block_hashes
from prefill.connector import PrefillConnector
from services.engine.engine import Engine, EngineConfig
from services.engine.kv_connector import BlockToSave, ImportedKV, KVSource, TensorKV
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest, FinishReason, Sequence
from services.model.kv_cache import KVCache, gather_blocks

PARAMS = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)


def prompt(n: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(n)).tolist()


class InMemory:
    """A worker half keeping what it is given to save: each block copied as it is reported,
    like a worker's store link; loads write a source into the cache."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[bytes, int, torch.Tensor, torch.Tensor]] = {}
        self.loads: list[list[tuple[int, int]]] = []

    def load(self, cache: KVCache, source: KVSource, items: list[tuple[int, int]]) -> None:
        self.loads.append(items)
        source.write(cache, items)

    def save(self, cache: KVCache, seq: Sequence, blocks: list[BlockToSave]) -> None:
        k, v = gather_blocks(cache, [b.block_id for b in blocks])
        for i, b in enumerate(blocks):
            self.blocks[b.index] = (b.block_hash, b.num_tokens, k[i].clone(), v[i].clone())


def engine(embedded, io: InMemory | None = None, **config) -> Engine:
    config.setdefault("num_blocks", 64)
    return Engine(embedded.model, embedded.tokenizer, EngineConfig(**config), kv_connector=io)


def test_prefill_exports_every_prompt_block_then_decode_continues(embedded):
    ids = prompt(70)  # 4 full blocks and a partial one of 6 tokens
    expected = engine(embedded).generate([ids], PARAMS)[0].choices[0].token_ids

    saved = InMemory()
    prefill = engine(embedded, saved, max_num_batched_tokens=32)
    full = block_hashes(ids, 16, prefill.blocks.namespace)
    partial = block_hashes(ids, 16, prefill.blocks.namespace, include_partial=True)[-1]
    connector = PrefillConnector(full, partial, None)
    prefill.add_request(EngineRequest("r", ids, PARAMS, block_hashes=full), connector)
    deltas = []
    while prefill.has_unfinished:
        deltas += prefill.step()
    assert [d.finish_reason for d in deltas] == [FinishReason.HANDED_OFF]
    first = deltas[0].token_ids[0]
    assert first == expected[0]
    assert [saved.blocks[i][0] for i in range(5)] == [*full, partial]
    assert [saved.blocks[i][1] for i in range(5)] == [16, 16, 16, 16, 6]
    assert prefill.blocks.referenced_blocks() == 0

    k = torch.stack([saved.blocks[i][2] for i in range(5)])
    v = torch.stack([saved.blocks[i][3] for i in range(5)])
    loaded = InMemory()
    decode = engine(embedded, loaded)
    kv = ImportedKV(full, TensorKV(k, v), 16, partial_tokens=6)
    decode.add_request(
        EngineRequest("r", ids, PARAMS, output_ids=[first]), DecodeConnector(full, kv, True)
    )
    out = []
    while decode.has_unfinished:
        out += [t for d in decode.step() for t in d.token_ids]
    seq_tokens = [first, *out]
    assert seq_tokens == expected
    assert decode.times.steps == 11  # nothing recomputed: one step per new token
    assert [[i for i, _ in items] for items in loaded.loads] == [[0, 1, 2, 3, 4]]
    # written back at the end: the full blocks past the 4 the store holds (prompt and answer)
    answer = block_hashes([*ids, *seq_tokens], 16, decode.blocks.namespace)
    assert {i: b[:2] for i, b in loaded.blocks.items()} == {4: (answer[4], 16)}


def test_an_import_missing_blocks_is_completed_by_recomputing(embedded):
    ids = prompt(50)
    expected = engine(embedded).generate([ids], PARAMS)[0].choices[0].token_ids
    first_engine = engine(embedded)
    first_engine.generate([ids], SamplingParams(max_tokens=1))  # blocks 0-2 now cached there
    full = block_hashes(ids, 16, first_engine.blocks.namespace)
    kept = first_engine.blocks.lookup(full)
    k, v = gather_blocks(first_engine.runner.kv, kept[:1])  # only block 0 "survived" in the store
    decode = engine(embedded, InMemory())
    kv = ImportedKV(full[:1], TensorKV(k, v), 16)
    decode.add_request(
        EngineRequest("r", ids, PARAMS, output_ids=[expected[0]]),
        DecodeConnector(full, kv, False),
    )
    out = []
    while decode.has_unfinished:
        out += [t for d in decode.step() for t in d.token_ids]
    assert [expected[0], *out] == expected
    assert decode.requests == {}


def _import_with_first_two_blocks_unfetched(embedded, ids):
    """An import of 4 full blocks whose first 2 were not fetched (the worker saw them cached):
    NaN stands where their values would be, so using them would show in the tokens."""
    source = engine(embedded)
    source.generate([ids], SamplingParams(max_tokens=1))
    hashes = block_hashes(ids, 16, source.blocks.namespace)[:4]
    k, v = gather_blocks(source.runner.kv, source.blocks.lookup(hashes))
    k[:2], v[:2] = float("nan"), float("nan")
    return ImportedKV(hashes, TensorKV(k, v), 16, skipped=2)


@pytest.mark.parametrize("still_cached", [True, False])
def test_unfetched_leading_blocks_come_from_the_cache_or_are_recomputed(embedded, still_cached):
    ids = prompt(70)
    expected = engine(embedded).generate([ids], PARAMS)[0].choices[0].token_ids
    decode = engine(embedded, InMemory())
    if still_cached:  # the worker's view held: blocks 0-1 are in this engine's cache
        decode.generate([ids[:40]], SamplingParams(max_tokens=1))
    kv = _import_with_first_two_blocks_unfetched(embedded, ids)
    decode.add_request(
        EngineRequest("r", ids, PARAMS, output_ids=[expected[0]]), DecodeConnector([], kv, False)
    )
    deltas = []
    while decode.has_unfinished:
        deltas += decode.step()
    assert [expected[0], *(t for d in deltas for t in d.token_ids)] == expected
    # cached: 2 blocks from the cache + 2 from the store; evicted: the import stops at once
    assert deltas[-1].num_cached_tokens == (64 if still_cached else 0)
    assert deltas[-1].num_external_tokens == (32 if still_cached else 0)


class CountingHashes:
    """kvstore.block_hash's hashlib, counting the SHA-256s it makes."""

    def __init__(self) -> None:
        import hashlib

        self.calls = 0
        self._sha256 = hashlib.sha256

    def sha256(self, data: bytes = b""):
        self.calls += 1
        return self._sha256(data)


@pytest.mark.parametrize("given", [True, False])
def test_a_prompts_block_hashes_given_with_the_request_are_not_computed_again(
    embedded, monkeypatch, given
):
    ids = prompt(70)  # 4 full blocks
    prefill = engine(embedded, InMemory())
    full = block_hashes(ids, 16, prefill.blocks.namespace)
    partial = block_hashes(ids, 16, prefill.blocks.namespace, include_partial=True)[-1]
    counting = CountingHashes()
    monkeypatch.setattr("kvstore.block_hash.hashlib", counting)
    request = EngineRequest("r", ids, PARAMS, block_hashes=full if given else ())
    prefill.add_request(request, PrefillConnector(full, partial, None))
    while prefill.has_unfinished:
        prefill.step()
    assert counting.calls == (0 if given else 4)
