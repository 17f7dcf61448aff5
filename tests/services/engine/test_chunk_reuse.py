"""Approximate KV reuse in the engine (services/engine/chunk_reuse.py) on the embedded model:

- a prompt whose marked chunks another prompt computed, at other positions after other text,
  is computed over their K/V as the dense reference (bench/kv_blend.py `Dense.blend`) computes
  it: the same first-token logprobs (float32, within 2e-3), the same greedy tokens, the same
  count of recomputed tokens, at ratios 0, 0.3 and 1;
- exact prefix blocks are never named after approximate KV: the same prompt asked exactly
  afterwards gets full computation's tokens and logprobs bit for bit, its cached tokens only
  those before the first reused chunk;
- requests batched with an approximate one get their alone results bit for bit, in every
  dtype the CPU runs;
- at its bounds, for Llama attention and DeepSeek's latent attention: chunks placed where
  they were computed are exact; moved and all recomputed, full computation; none recomputed,
  not;
- what is refused: a model without the capability (DeepSeek-V4), chunks out of order, a
  request choosing where the operator forbids it.
"""

from __future__ import annotations

import pytest
import torch

from bench.kv_blend import Dense, Reused
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams, ValidationError
from services.engine.request import EngineRequest
from services.model.layers.attention import CpuAttention
from services.model.loader import LoadedModel, load_model
from services.settings import ReuseConfig
from tests.support.dtypes import COMPUTE_DTYPES

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
TEXTS = dict(
    head="You answer questions about the notes below, briefly and exactly.\n",
    other="Notes follow. Read them all before you answer the question at the end.\n",
    first="The first note says that the lighthouse keeper of Arden paints the old door blue "
    "every May, and that the key to the lamp room hangs behind the kitchen clock.\n",
    second="The second note says that the ferry from Bellmoor leaves at nine in the morning, "
    "returns at six in the evening, and never sails when the harbour bell is silent.\n",
    question="Question: when does the ferry return? Answer:",
)


@pytest.fixture(scope="module")
def pieces(embedded) -> dict[str, list[int]]:
    return {k: embedded.tokenizer.encode(t, add_special_tokens=False) for k, t in TEXTS.items()}


def marked(*parts: list[int], chunks: tuple[int, ...]) -> tuple[list[int], tuple]:
    """The parts joined, and the spans of those at `chunks` (indices)."""
    ids: list[int] = []
    spans = []
    for i, part in enumerate(parts):
        if i in chunks:
            spans.append((len(ids), len(ids) + len(part)))
        ids += part
    return ids, tuple(spans)


def engine(model: LoadedModel, ratio: float = 0.3, **reuse) -> Engine:
    config = EngineConfig(
        num_blocks=64, reuse=ReuseConfig(kv_reuse="approximate", ratio=ratio, **reuse)
    )
    return Engine(model.model, model.tokenizer, config)


def run(eng: Engine, rid: str, ids: list[int], chunks=(), kv_reuse=None, params=GREEDY):
    eng.add_request(EngineRequest(rid, ids, params, kv_reuse=kv_reuse, chunks=chunks))
    seq = eng.requests[rid].seqs[0]
    while eng.has_unfinished:
        eng.step()
    eng.check()
    return seq


@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_the_engine_computes_a_moved_chunk_as_the_dense_reference(
    embedded, embedded_dir, pieces, ratio
):
    p = pieces
    first_ids, first_chunks = marked(p["head"], p["first"], p["second"], p["question"],
                                     chunks=(1, 2))  # fmt: skip
    ids, chunks = marked(p["other"], p["second"], p["first"], p["question"], chunks=(1, 2))
    eng = engine(embedded, ratio)
    seen = run(eng, "seen", first_ids, first_chunks)
    assert seen.num_reused_tokens == 0 and len(eng.reuse.cache.entries) == 2
    seq = run(eng, "moved", ids, chunks)

    dense = Dense(embedded_dir)
    cache, _ = dense.extend(None, first_ids)
    (a1, b1), (a2, b2) = first_chunks
    reused = [Reused(chunks[0][0], cache.slice(a2, b2), a2),
              Reused(chunks[1][0], cache.slice(a1, b1), a1)]  # fmt: skip
    blended, last, recomputed = dense.blend(ids, reused, ratio)
    assert seq.num_reused_tokens == len(p["first"]) + len(p["second"])
    assert seq.num_recomputed_tokens == recomputed
    assert seq.approximate_from == chunks[0][0]
    theirs = torch.log_softmax(last, -1)
    top = seq.logprobs[0].top
    assert [t for t, _ in top] == theirs.topk(len(top)).indices.tolist()
    assert max(abs(lp - theirs[t].item()) for t, lp in top) <= 2e-3
    tokens = []
    for _ in range(GREEDY.max_tokens):  # the reference's greedy continuation
        tokens.append(int(last.argmax()))
        blended, logits = dense.extend(blended, tokens[-1:])
        last = logits[-1]
    assert seq.output_ids == tokens


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["embedded", "deepseek_v3"])
def family_model(request, embedded, tiny_dir) -> LoadedModel:
    if request.param == "embedded":
        return embedded
    return load_model(str(tiny_dir(request.param)), dtype="float32", device="cpu")


def first_logprobs(eng: Engine, rid: str, prompt: list[int], chunks=(), kv_reuse=None):
    seq = run(eng, rid, prompt, chunks, kv_reuse)
    return seq, torch.tensor([lp for _, lp in seq.logprobs[0].top])


def test_what_reuse_equals_at_its_bounds(family_model):
    """For Llama attention and DeepSeek's latent attention alike: chunks placed where they
    were computed, after the same text, are exact (nothing turned, nothing recomputed but
    each chunk's first); moved and all recomputed (ratio 1) they are full computation; moved
    and none recomputed they are not."""
    x, y, q = ids(40, 1), ids(40, 2), ids(9, 3)
    seen, seen_chunks = marked(ids(20, 4), x, y, q, chunks=(1, 2))
    moved, moved_chunks = marked(ids(27, 5), y, x, q, chunks=(1, 2))
    exact_seen = first_logprobs(engine(family_model), "exact", seen, kv_reuse="exact")[1]
    exact_moved = first_logprobs(engine(family_model), "exact", moved, kv_reuse="exact")[1]
    config = EngineConfig(num_blocks=64, enable_prefix_caching=False,
                          reuse=ReuseConfig(kv_reuse="approximate", ratio=0.0))  # fmt: skip
    eng = Engine(family_model.model, family_model.tokenizer, config)
    run(eng, "seen", seen, seen_chunks)
    again, logprobs = first_logprobs(eng, "again", seen, seen_chunks)
    assert (again.num_reused_tokens, again.num_recomputed_tokens) == (80, 2)
    assert (logprobs - exact_seen).abs().max() <= 1e-4
    for ratio, close in ((1.0, True), (0.0, False)):
        eng = engine(family_model, ratio)
        run(eng, "seen", seen, seen_chunks)
        seq, logprobs = first_logprobs(eng, "moved", moved, moved_chunks)
        assert seq.num_reused_tokens == 80
        assert seq.num_recomputed_tokens == (80 if ratio else 2)
        assert ((logprobs - exact_moved).abs().max() <= 1e-4) == close, ratio


def test_exact_prefix_blocks_never_hold_approximate_kv(embedded, pieces):
    p = pieces
    first_ids, first_chunks = marked(p["head"], p["first"], p["second"], p["question"],
                                     chunks=(1, 2))  # fmt: skip
    ids, chunks = marked(p["head"], p["second"], p["first"], p["question"], chunks=(1, 2))
    eng = engine(embedded)
    run(eng, "seen", first_ids, first_chunks)
    approximate = run(eng, "moved", ids, chunks)
    assert approximate.num_reused_tokens > 0
    exact = run(eng, "asked-exactly", ids, chunks, kv_reuse="exact")
    cold = run(engine(embedded), "cold", ids, chunks, kv_reuse="exact")
    assert exact.num_reused_tokens == 0
    assert exact.num_cached_tokens == len(p["head"]) // 16 * 16
    assert (exact.output_ids, exact.logprobs) == (cold.output_ids, cold.logprobs)


@pytest.fixture(scope="module", params=COMPUTE_DTYPES)
def model(request, embedded, embedded_dir) -> LoadedModel:
    loaded = embedded if request.param == "float32" else load_model(
        str(embedded_dir), dtype=request.param, device="cpu"
    )  # fmt: skip
    if not isinstance(loaded.model.attention, CpuAttention) or not loaded.model.packed:
        pytest.skip("bitwise guarantees hold for the C attention kernels and oneDNN products")
    return loaded


def test_requests_batched_with_an_approximate_one_get_their_alone_results(model, pieces):
    p = pieces
    first_ids, first_chunks = marked(p["head"], p["first"], p["second"], p["question"],
                                     chunks=(1, 2))  # fmt: skip
    ids, chunks = marked(p["other"], p["second"], p["first"], p["question"], chunks=(1, 2))
    others = [p["other"] + p["question"], p["first"] + p["head"] + p["question"]]
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True, logprobs=2)
    alone = [run(engine(model), f"alone-{i}", o, params=seeded) for i, o in enumerate(others)]
    eng = engine(model)
    run(eng, "seen", first_ids, first_chunks)
    eng.add_request(EngineRequest("moved", ids, GREEDY, chunks=chunks))
    for i, o in enumerate(others):
        eng.add_request(EngineRequest(f"other-{i}", o, seeded, kv_reuse="exact"))
    seqs = {rid: live.seqs[0] for rid, live in eng.requests.items()}
    while eng.has_unfinished:
        eng.step()
    eng.check()
    assert seqs["moved"].num_reused_tokens > 0
    for i, a in enumerate(alone):
        b = seqs[f"other-{i}"]
        assert (b.output_ids, b.logprobs) == (a.output_ids, a.logprobs), f"request {i}"


def test_what_is_refused(embedded, tiny_dir, pieces):
    eng = engine(embedded, requests=False)
    with pytest.raises(ValidationError, match="may not choose"):
        eng.add_request(EngineRequest("a", pieces["head"], GREEDY, kv_reuse="exact"))
    with pytest.raises(ValidationError, match="chunks"):
        eng.add_request(EngineRequest("b", pieces["head"], GREEDY, chunks=((4, 9), (2, 6))))
    with pytest.raises(ValidationError, match="not exact or approximate"):
        engine(embedded).add_request(EngineRequest("c", [1, 2], GREEDY, kv_reuse="fuzzy"))
    v4 = load_model(str(tiny_dir("deepseek_v4")), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"not available for deepseek_v4: .* compressed"):
        engine(v4)
    plain = Engine(v4.model, v4.tokenizer, EngineConfig(num_blocks=16))
    with pytest.raises(ValidationError, match="not available"):
        plain.add_request(EngineRequest("d", [1, 2, 3], GREEDY, kv_reuse="approximate"))
