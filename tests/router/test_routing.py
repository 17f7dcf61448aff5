"""Routing policies over 2 prefill and 2 decode workers: KV-aware routing finds prompts in the
worker's own cache more often than round robin, measured from each router's /metrics; and
conditional disaggregation."""

from __future__ import annotations

import random

import openai

from services.engine.params import SamplingParams
from services.launcher import RouterProcess
from tests.support.cluster import MODEL, addresses, metrics, reference

GROUPS, PER_GROUP, PREFIX_WORDS = 6, 4, 120


def shared_prefix_workload(seed: int) -> list[str]:
    """GROUPS system prompts of PREFIX_WORDS random words, each followed by PER_GROUP
    questions; groups one after another, as conversations of one tenant arrive."""
    rng = random.Random(seed)
    words = ["alpha", "delta", "river", "stone", "cloud", "maple", "orbit", "prism", "quartz"]
    prompts = []
    for g in range(GROUPS):
        prefix = " ".join(rng.choice(words) for _ in range(PREFIX_WORDS))
        prompts += [f"{prefix}\nQuestion {g}.{q}: what comes next?" for q in range(PER_GROUP)]
    return prompts


def hit_ratio(pool, tmp_path, policy: str, seed: int) -> float:
    prefill, decode = pool
    router = RouterProcess(
        tmp_path, addresses(prefill), addresses(decode), "--policy", policy
    ).start()
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        for prompt in shared_prefix_workload(seed):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        values = metrics(router.url)
        ok = ("pdserve_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
        assert values[ok] == GROUPS * PER_GROUP
        hits = values[("pdserve_prefix_cache_hit_tokens_total", ())]
        queried = values[("pdserve_prefix_cache_queried_tokens_total", ())]
        assert values[("pdserve_prefix_cache_hit_ratio", ())] == hits / queried
        return hits / queried
    finally:
        router.stop()


def test_kv_aware_routing_hits_the_prefix_cache_more_than_round_robin(pool, tmp_path):
    # Round robin sends a group's requests to both prefill workers in turn: the second one
    # reads the prefix from the store (not a cache hit), only the third and fourth find it
    # cached. KV-aware sends the whole group where its prefix is: three of four hit.
    round_robin = hit_ratio(pool, tmp_path, "round_robin", seed=1)
    kv_aware = hit_ratio(pool, tmp_path, "kv_aware", seed=2)
    print(f"prefix-cache hit ratio: kv_aware {kv_aware:.3f}, round_robin {round_robin:.3f}")
    assert kv_aware > round_robin + 0.15, (kv_aware, round_robin)
    assert 0.3 < round_robin < 0.5 < kv_aware < 0.75, (kv_aware, round_robin)


def test_conditional_disaggregation_sends_short_prompts_straight_to_decode(
    pool, tmp_path, engine, embedded
):
    prefill, decode = pool
    router = RouterProcess(
        tmp_path, addresses(prefill), addresses(decode), "--disagg-threshold", "64"
    ).start()
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        short = "Name a color:"
        long = "Summarize: " + " ".join(f"fact {i} is that water is wet;" for i in range(40))
        local = ("pdserve_local_prefills_total", (("reason", "short_prompt"),))
        params = SamplingParams(max_tokens=6, temperature=0)
        for prompt, skipped in ((short, 1), (long, 1)):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
            ids = embedded.tokenizer.encode(prompt)
            assert r.choices[0].text == reference(engine, ids, params)[0]
            assert metrics(router.url).get(local, 0) == skipped  # the long one was prefilled
    finally:
        router.stop()
