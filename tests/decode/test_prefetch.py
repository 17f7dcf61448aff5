"""Prefetch (decode/prefetch.py): a decode worker reading a long prompt's blocks while the
prefill worker still computes and writes them, and the Decode using what it read; through the
router too. Real workers on the session's Redis, tokens equal to one in-process engine's."""

from __future__ import annotations

import asyncio

import openai
import torch

from services.engine.params import SamplingParams
from services.rpc import worker_pb2 as pb
from services.worker.convert import to_proto_params
from tests.decode.test_disaggregated import stubs
from tests.support.cluster import MODEL, log_events, log_size, reference
from tests.support.workers import disaggregated

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def events(worker, since: int, msg: str, rid: str) -> list[dict[str, str]]:
    return [e for e in log_events(worker, since) if e.get("msg") == msg and e["request_id"] == rid]


def test_a_prefetch_overlaps_the_prefill_and_the_decode_reads_nothing_twice(workers, engine):
    _, decode_worker = workers
    ids = prompt(1500, seed=7003)  # 93 full blocks and a partial one of 12 tokens; a seed no
    # other test uses (prompt(n, seed) begins as every other prompt of that seed does)
    since = log_size(decode_worker)

    async def run():
        prefill, decode, channels = stubs(workers)
        hits = (await decode.Load(pb.LoadRequest())).store_hits
        started = await decode.Prefetch(pb.PrefetchRequest(request_id="pf", prompt_token_ids=ids))
        tokens, _, _ = await disaggregated(prefill, decode, "pf", ids, to_proto_params(GREEDY), 0)
        read = (await decode.Load(pb.LoadRequest())).store_hits - hits
        for ch in channels:
            await ch.close()
        return started.started, tokens, read

    started, tokens, read = asyncio.run(run())
    expected = engine.generate([ids], GREEDY)[0].choices[0].token_ids
    assert started and tokens == expected
    assert read == 94  # each block once: 93 by the prefetch and the Decode, the partial one
    (prefetched,) = events(decode_worker, since, "prefetched", "pf")
    assert int(prefetched["blocks"]) == 93
    assert int(prefetched["polls"]) > 0  # it read blocks before the prefill had written all
    (fetched,) = events(decode_worker, since, "fetched", "pf")
    assert fetched["choice"] == "prefetched" and fetched["blocks"] == "94"


def test_a_prefetch_of_another_prompt_or_aborted_is_not_used(workers, engine):
    _, decode_worker = workers
    since = log_size(decode_worker)
    a, b = prompt(400, seed=7005), prompt(400, seed=7006)

    async def run():
        prefill, decode, channels = stubs(workers)
        params = to_proto_params(GREEDY)
        await decode.Prefetch(pb.PrefetchRequest(request_id="other", prompt_token_ids=a))
        other, _, _ = await disaggregated(prefill, decode, "other", b, params, 0)
        await decode.Prefetch(pb.PrefetchRequest(request_id="gone", prompt_token_ids=a))
        assert (await decode.Abort(pb.AbortRequest(request_id="gone"))).found is True
        gone, _, _ = await disaggregated(prefill, decode, "gone", a, params, 0)
        for ch in channels:
            await ch.close()
        return other, gone

    other, gone = asyncio.run(run())
    outputs = engine.generate([b, a], GREEDY)
    assert [other, gone] == [o.choices[0].token_ids for o in outputs]
    for rid in ("other", "gone"):
        (fetched,) = events(decode_worker, since, "fetched", rid)
        assert fetched["choice"] != "prefetched", rid


def test_the_router_prefetches_long_prompts(router, pool, engine, embedded):
    """A prompt past prefetch_tokens (1024): the decode worker it goes to read it early."""
    _, decode = pool
    since = [log_size(w) for w in decode]
    text = " ".join(f"Line {i}: the tide came in at {i % 12} o'clock." for i in range(100))
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    ids = embedded.tokenizer.encode(text)
    assert len(ids) > 1024 and [c.text for c in r.choices] == reference(
        engine, ids, SamplingParams(max_tokens=8, temperature=0)
    )
    lines = [e for w, at in zip(decode, since, strict=True) for e in log_events(w, at)]
    (prefetched,) = [e for e in lines if e.get("msg") == "prefetched"]
    (fetched,) = [e for e in lines if e.get("msg") == "fetched"]
    assert fetched["choice"] == "prefetched"
    assert fetched["request_id"] == prefetched["request_id"]
    assert int(prefetched["blocks"]) == len(ids) // 16
