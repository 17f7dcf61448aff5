"""The handoff in one process: a prefill-only engine exports a prompt's blocks, a second
engine imports them and continues; tokens equal one engine doing it all."""

from __future__ import annotations

import pytest
import torch

from decode.transfer import DecodeTransfer
from kvstore.block_hash import block_hashes
from prefill.transfer import PrefillTransfer
from services.engine.engine import Engine, EngineConfig
from services.engine.kv_transfer import ImportedKV, TensorKV
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest, FinishReason
from services.model.kv_cache import gather_blocks

PARAMS = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)


def prompt(n: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(n)).tolist()


class Collector:
    """An exporter that copies each block as it is reported, like a worker would."""

    def __init__(self, engine_ref: list[Engine]) -> None:
        self.engine_ref = engine_ref
        self.blocks: dict[int, tuple[bytes, int, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, seq, ready) -> None:
        k, v = gather_blocks(self.engine_ref[0].kv, [b.block_id for b in ready])
        for i, b in enumerate(ready):
            self.blocks[b.index] = (b.block_hash, b.num_tokens, k[i].clone(), v[i].clone())


def test_prefill_exports_every_prompt_block_then_decode_continues(embedded):
    ids = prompt(70)  # 4 full blocks and a partial one of 6 tokens
    whole = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    expected = whole.generate([ids], PARAMS)[0].choices[0].token_ids

    ref: list[Engine] = []
    collect = Collector(ref)
    prefill = Engine(embedded.model, embedded.tokenizer,
                     EngineConfig(num_blocks=64, max_num_batched_tokens=32))  # fmt: skip
    ref.append(prefill)
    full = block_hashes(ids, 16, prefill.blocks.namespace)
    partial = block_hashes(ids, 16, prefill.blocks.namespace, include_partial=True)[-1]
    transfer = PrefillTransfer(None, collect, partial)
    prefill.add_request(EngineRequest("r", ids, PARAMS, transfer=transfer))
    deltas = []
    while prefill.has_unfinished:
        deltas += prefill.step()
    assert [d.finish_reason for d in deltas] == [FinishReason.PREFILLED]
    first = deltas[0].token_ids[0]
    assert first == expected[0]
    assert [collect.blocks[i][0] for i in range(5)] == [*full, partial]
    assert [collect.blocks[i][1] for i in range(5)] == [16, 16, 16, 16, 6]
    assert prefill.blocks.referenced_blocks() == 0

    k = torch.stack([collect.blocks[i][2] for i in range(5)])
    v = torch.stack([collect.blocks[i][3] for i in range(5)])
    decode = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    kv = ImportedKV(full, TensorKV(k, v), 16, partial_tokens=6)
    decode.add_request(
        EngineRequest("r", ids, PARAMS, output_ids=[first], transfer=DecodeTransfer(kv, None))
    )
    out = []
    while decode.has_unfinished:
        out += [t for d in decode.step() for t in d.token_ids]
    seq_tokens = [first, *out]
    assert seq_tokens == expected
    assert decode.times.steps == 11  # nothing recomputed: one step per new token


def test_an_import_missing_blocks_is_completed_by_recomputing(embedded):
    ids = prompt(50)
    whole = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    expected = whole.generate([ids], PARAMS)[0].choices[0].token_ids
    first_engine = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    first_engine.generate([ids], SamplingParams(max_tokens=1))  # blocks 0-2 now cached there
    kept = first_engine.blocks.lookup(
        first_engine.blocks.hashes(whole.requests.get("x") or _seq(ids))
    )
    k, v = gather_blocks(first_engine.kv, kept[:1])  # only block 0 "survived" in the store
    decode = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    kv = ImportedKV(block_hashes(ids, 16, decode.blocks.namespace)[:1], TensorKV(k, v), 16)
    decode.add_request(
        EngineRequest("r", ids, PARAMS, output_ids=[expected[0]], transfer=DecodeTransfer(kv, None))
    )
    out = []
    while decode.has_unfinished:
        out += [t for d in decode.step() for t in d.token_ids]
    assert [expected[0], *out] == expected
    assert decode.requests == {}


def _seq(ids):
    from services.engine.request import Sequence

    return Sequence("x", 0, len(ids), list(ids), PARAMS, 0, 0)


def _import_with_first_two_blocks_unfetched(embedded, ids):
    """An import of 4 full blocks whose first 2 were not fetched (the worker saw them cached):
    NaN stands where their values would be, so using them would show in the tokens."""
    source = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    source.generate([ids], SamplingParams(max_tokens=1))
    hashes = block_hashes(ids, 16, source.blocks.namespace)[:4]
    k, v = gather_blocks(source.kv, source.blocks.lookup(hashes))
    k[:2], v[:2] = float("nan"), float("nan")
    return ImportedKV(hashes, TensorKV(k, v), 16, skipped=2)


@pytest.mark.parametrize("still_cached", [True, False])
def test_unfetched_leading_blocks_come_from_the_cache_or_are_recomputed(embedded, still_cached):
    ids = prompt(70)
    whole = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    expected = whole.generate([ids], PARAMS)[0].choices[0].token_ids
    decode = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=64))
    if still_cached:  # the worker's view held: blocks 0-1 are in this engine's cache
        decode.generate([ids[:40]], SamplingParams(max_tokens=1))
    kv = _import_with_first_two_blocks_unfetched(embedded, ids)
    decode.add_request(
        EngineRequest("r", ids, PARAMS, output_ids=[expected[0]], transfer=DecodeTransfer(kv, None))
    )
    deltas = []
    while decode.has_unfinished:
        deltas += decode.step()
    assert [expected[0], *(t for d in deltas for t in d.token_ids)] == expected
    # cached: 2 blocks from the cache + 2 from the store; evicted: the import stops at once
    assert deltas[-1].num_cached_tokens == (64 if still_cached else 0)
    assert deltas[-1].num_store_tokens == (32 if still_cached else 0)
