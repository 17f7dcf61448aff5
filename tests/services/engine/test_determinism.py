"""Exact results in every dtype `--dtype auto` picks here: a request's tokens, their logprobs
and the KV bytes behind them do not depend on the requests batched with it, on how its prompt
was chunked, on whether its prefix came from the cache, or on whether its output was decoded
or recomputed (a migrated stream). Bitwise comparisons throughout, float32 and bfloat16 alike,
for Llama-style attention (the embedded model), for DeepSeek-V3's latent attention with
mixture-of-experts layers (a tiny random checkpoint: the cache holds latents, and tokens that
share an expert in a step must not change each other's results), for DeepSeek-V4 (windows,
compressed entries made as their windows close, hyper-connections, hash and top-k experts)
for gpt-oss (sliding and full layers with sinks) and for Gemma 3 (local and global layers).

Logprobs are compared with the tokens: a logit that moved shows there even when the argmax
(or the draw) happens not to change."""

from __future__ import annotations

import pytest
import torch

from kvstore.block_hash import block_hashes
from services.engine.engine import Engine, EngineConfig
from services.engine.outputs import RequestOutput
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest, TokenLogprobs
from services.engine.speculative import SpeculativeConfig
from services.model.families.deepseek.mla import CpuMlaAttention
from services.model.families.deepseek_v4.model import DeepseekV4Model
from services.model.families.gemma3.model import Gemma3Model
from services.model.families.gpt_oss.model import GptOssModel
from services.model.kv_cache import gather_blocks
from services.model.layers.attention import CpuAttention
from services.model.loader import LoadedModel, load_model
from tests.support.dtypes import COMPUTE_DTYPES

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    max_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True, logprobs=2
)
# one past a block (a cache hit leaves a single token to compute), block-aligned, in between
LENGTHS = [3, 17, 33, 40, 49, 64, 65, 81, 100, 111, 129, 150, 16, 31, 97, 120]

Result = tuple[list[int], list[TokenLogprobs]]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def with_(params: SamplingParams, **changes) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, **changes})


@pytest.fixture(scope="module")
def deepseek_dir(tiny_dir):
    return tiny_dir("deepseek_v3")


@pytest.fixture(
    scope="module",
    params=["embedded", "deepseek_v3", "deepseek_v32", "deepseek_v4", "gpt_oss", "gemma3"],
)
def family(request):
    return request.param


@pytest.fixture(scope="module", params=COMPUTE_DTYPES)
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(dtype, family, embedded_dir, embedded, tiny_dir) -> LoadedModel:
    if family == "embedded" and dtype == "float32":
        loaded = embedded
    else:
        path = embedded_dir if family == "embedded" else tiny_dir(family)
        loaded = load_model(str(path), dtype=dtype, device="cpu")
    if isinstance(loaded.model, DeepseekV4Model | GptOssModel | Gemma3Model):  # per-row attention
        if not loaded.model.packed:
            pytest.skip("bitwise guarantees hold for oneDNN's products")
        return loaded
    kernel = getattr(loaded.model, "mla", None) or loaded.model.attention
    if not isinstance(kernel, CpuAttention | CpuMlaAttention) or not loaded.model.packed:
        pytest.skip("bitwise guarantees hold for the C attention kernels and oneDNN products")
    return loaded


def engine(model: LoadedModel, num_blocks: int = 32, **config) -> Engine:
    """A fresh engine; a small pool, as every test makes several."""
    return Engine(model.model, model.tokenizer, EngineConfig(num_blocks=num_blocks, **config))


def results(outputs: list[RequestOutput]) -> list[Result]:
    return [(o.choices[0].token_ids, o.choices[0].logprobs) for o in outputs]


def cached_kv(eng: Engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the full blocks of `ids` that `eng` computed (all of them must be cached)."""
    hashes = block_hashes(ids, eng.config.block_size, eng.blocks.namespace)
    found = eng.blocks.lookup(hashes)
    assert len(found) == len(hashes), "a block of the sequence is not in the cache"
    return gather_blocks(eng.runner.kv, found)


def assert_same_kv(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)), "K bytes differ"
    assert torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8)), "V bytes differ"


@pytest.mark.all_cores  # (tests/conftest.py)
def test_a_request_gets_the_same_results_alone_or_among_15_others(model):
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    params = [GREEDY] * 16
    params[7] = SEEDED
    together = results(engine(model, num_blocks=128).generate(prompts, params))
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        alone = results(engine(model).generate([p], q))[0]
        assert together[i] == alone, f"request {i} ({len(p)} tokens, seeded: {q.seed})"


@pytest.mark.parametrize(
    ("budget", "chunk"),
    [(64, 16), (7, 7), (1, 1)],  # whole blocks; chunks across blocks; one token a step
)
def test_chunking_changes_neither_results_nor_kv(model, budget, chunk):
    prompts = [prompt(45, seed=1), prompt(21, seed=2)]
    params = [GREEDY, SEEDED]
    whole = engine(model)
    expected = results(whole.generate(prompts, params))
    chunked = engine(model, max_num_batched_tokens=budget, prefill_chunk_size=chunk)
    assert results(chunked.generate(prompts, params)) == expected
    for p, (out, _) in zip(prompts, expected, strict=True):
        computed = [*p, *out[:-1]]  # the last token is sampled, never fed back
        assert_same_kv(cached_kv(chunked, computed), cached_kv(whole, computed))


def test_a_prefix_cache_hit_gives_the_kv_and_results_of_computing_it(model):
    """Cold, then warm: the same prompts again, their prefixes found in the cache (the one of
    49 tokens computes a single token). Their KV equals that of an engine that found only the
    first block cached and computed the rest in one chunk."""
    prompts = [prompt(49, seed=3), prompt(64, seed=4), prompt(70, seed=5)]
    params = [GREEDY, GREEDY, SEEDED]
    eng = engine(model)
    cold = results(eng.generate(prompts, params))
    warm = eng.generate(prompts, params)
    assert [o.num_cached_tokens for o in warm] == [48, 48, 64]
    assert results(warm) == cold
    other = engine(model)
    other.generate([p[:20] for p in prompts], SamplingParams(max_tokens=1))
    partly = other.generate(prompts, params)
    assert [o.num_cached_tokens for o in partly] == [16, 16, 16]
    assert results(partly) == cold
    for p, (out, _) in zip(prompts, cold, strict=True):
        computed = [*p, *out[:-1]]
        assert_same_kv(cached_kv(other, computed), cached_kv(eng, computed))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_migrated_stream_continues_with_the_results_and_kv_it_had(model, params):
    """A decode worker taking over a stream computes the tokens already sent as one prefill
    chunk; they were decoded one at a time where the stream began."""
    ids, params = prompt(37, seed=6), with_(params, max_tokens=24)
    first = engine(model)
    [(expected, logprobs)] = results(first.generate([ids], params))
    second = engine(model)
    second.add_request(EngineRequest("moved", ids, params, output_ids=expected[:13]))
    deltas = []
    while second.has_unfinished:
        deltas += second.step()
    assert [t for d in deltas for t in d.token_ids] == expected[13:]
    assert [lp for d in deltas for lp in d.logprobs] == logprobs[13:]
    computed = [*ids, *expected[:-1]]
    assert_same_kv(cached_kv(second, computed), cached_kv(first, computed))


def test_seeded_sampling_repeats_and_depends_on_the_seed(model):
    ids = prompt(30, seed=7)
    runs = [results(engine(model).generate([ids], SEEDED))[0] for _ in range(2)]
    assert runs[0] == runs[1]
    other_seed = results(engine(model).generate([ids], with_(SEEDED, seed=99)))[0]
    assert other_seed[0] != runs[0][0]


def test_speculation_changes_no_token_and_no_logprob(model, family, deepseek_dir):
    """Drafts verified several tokens a step, accepted or not: the tokens and logprobs of
    decoding one at a time (for the embedded model, tests/services/engine/test_speculative.py
    shows it at length). DeepSeek-V4's outputs repeat no suffix of theirs: the V3 checkpoint
    (same vocabulary) drafts for it, and is mostly refused, so rejected rows, compressed
    entries their tokens closed included, are computed again (greedy only: a draft's
    probabilities make seeded draws rejection sampling, the same distribution by other draws)."""
    if family in ("embedded", "gpt_oss", "gemma3"):
        pytest.skip("test_speculative.py covers the Llama-style attention, V3 and V4 here")
    prompts = [prompt(12, seed=20 + i) * 4 for i in range(6)]  # repeats: suffixes to propose
    params = [with_(GREEDY, max_tokens=24)] * 5 + [with_(SEEDED, max_tokens=24)]
    if family == "deepseek_v4":
        params[5] = params[0]
    expected = results(engine(model, num_blocks=96).generate(prompts, params))
    spec = SpeculativeConfig("suffix", num_tokens=4, max_batch=64)
    draft = None
    if family == "deepseek_v4":
        spec = SpeculativeConfig("draft", num_tokens=4, max_batch=64)
        dtype = str(model.model.dtype).removeprefix("torch.")
        draft = load_model(str(deepseek_dir), dtype=dtype, device="cpu").model
    config = EngineConfig(num_blocks=96, speculative=spec)
    speculating = Engine(model.model, model.tokenizer, config, draft=draft)
    assert results(speculating.generate(prompts, params)) == expected
    assert speculating.speculator is not None and speculating.speculator.stats.proposed > 0
