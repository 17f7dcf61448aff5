"""Scoring a prompt through the router and 2 + 2 worker processes (float32): `echo` with
`logprobs` and `max_tokens: 0` (what lm-eval-harness sends) equal transformers' log_softmax on
the same weights, also for a prompt whose blocks are already cached; vLLM's `prompt_logprobs`
in completions and chat; and the engine's own prompt logprobs through chunked prefill and
preemption."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.loader import load_model
from tests.support.cluster import MODEL
from tests.support.dtypes import COMPUTE_DTYPES

CONTEXT = "The quick brown fox jumps over the lazy dog. " * 3


def expected_logprobs(reference, ids: list[int]) -> tuple[list[float], list[list[int]]]:
    """transformers' log_softmax: the logprob of each token after the first, and the top 5."""
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    chosen = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    return chosen, logp[:-1].topk(5, dim=-1).indices.tolist()


def completion(router, body: dict) -> dict:
    r = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("cached", [False, True])
def test_echo_logprobs_max_tokens_0_equal_transformers(router, reference, embedded, cached):
    prompt = CONTEXT + ("Again." if cached else "Once more.")
    if cached:  # its blocks in the workers' caches and the store first: scoring ignores them
        completion(router, {"prompt": prompt, "max_tokens": 1})
    ids = embedded.tokenizer.encode(prompt)
    body = completion(router, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    choice = body["choices"][0]
    assert choice["text"] == embedded.tokenizer.decode(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    chosen, _ = expected_logprobs(reference, ids)
    assert lp["token_logprobs"][1:] == pytest.approx(chosen, abs=1e-4)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_echo_logprobs_with_generation(router, embedded):
    prompt = CONTEXT + "The end"
    ids = embedded.tokenizer.encode(prompt)
    args = {"prompt": prompt, "max_tokens": 4, "logprobs": 2, "temperature": 0}
    plain = completion(router, args)["choices"][0]
    echoed = completion(router, {**args, "echo": True})["choices"][0]
    assert echoed["text"] == embedded.tokenizer.decode(ids) + plain["text"]
    lp = echoed["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][len(ids) :] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"][len(ids)] == len(embedded.tokenizer.decode(ids))


def test_vllm_prompt_logprobs(router, reference, embedded):
    prompt = CONTEXT + "Scored."
    ids = embedded.tokenizer.encode(prompt)
    chosen, top = expected_logprobs(reference, ids)
    body = completion(router, {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3})
    scores = body["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for i, entry in enumerate(scores[1:]):
        mine = entry[str(ids[i + 1])]
        assert mine["logprob"] == pytest.approx(chosen[i], abs=1e-4)
        assert mine["rank"] >= 1
        ranked = [int(t) for t, v in entry.items() if v["rank"] <= 3]
        assert set(top[i][:3]) <= set(ranked) | {ids[i + 1]}
    chat = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
        },
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    scores = chat.json()["prompt_logprobs"]
    assert scores[0] is None and all(len(e) == 1 for e in scores[1:])


def test_engine_prompt_logprobs_through_chunks_and_preemption(embedded, reference):
    """Chunked prefill (chunks of 16) under preemption: every prompt's logprobs still equal
    transformers', and they do not depend on the prefix cache holding the prompt."""
    prompts = [embedded.tokenizer.encode(f"{k}: " + CONTEXT * 2) for k in range(6)]
    eng = Engine(
        embedded.model,
        embedded.tokenizer,
        EngineConfig(num_blocks=20, max_num_batched_tokens=64, prefill_chunk_size=16),
    )
    params = SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=2, ignore_eos=True)
    outputs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outputs, strict=True):
        chosen, top = expected_logprobs(reference, ids)
        assert [e.logprob for e in out.prompt_logprobs] == pytest.approx(chosen, abs=1e-4)
        assert [e.token_id for e in out.prompt_logprobs] == ids[1:]
        assert [[t for t, _ in e.top] for e in out.prompt_logprobs] == [t[:2] for t in top]
    again = eng.generate(prompts[:1], params)[0]  # now cached: computed again all the same
    assert again.prompt_logprobs == outputs[0].prompt_logprobs
    eng.check()
    assert eng.blocks.referenced_blocks() == 0


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_prompt_logprobs_do_not_depend_on_chunks_batch_or_cache(embedded_dir, dtype):
    """In every dtype auto may pick: a prompt scored alone in one chunk, and scored in chunks
    of 16 beside five others under preemption, then again with its blocks cached, gives the
    same bits."""
    loaded = load_model(str(embedded_dir), dtype=dtype, device="cpu")
    prompts = [loaded.tokenizer.encode(f"{k}: " + CONTEXT * 2) for k in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2, ignore_eos=True)
    alone = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    expected = [alone.generate([p], params)[0].prompt_logprobs for p in prompts]
    busy = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(num_blocks=20, max_num_batched_tokens=64, prefill_chunk_size=16),
    )
    outputs = busy.generate(prompts, params)
    assert busy.scheduler.num_preemptions > 0
    assert [o.prompt_logprobs for o in outputs] == expected
    assert alone.generate(prompts[:1], params)[0].prompt_logprobs == expected[0]  # cached now
