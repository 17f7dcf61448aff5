"""`--speculative mtp`: a DeepSeek-V3 or V4 checkpoint's own multi-token-prediction layer
drafts (families/deepseek/mtp.py, services/engine/mtp_proposer.py), on checkpoints made here: one
whose MTP layer is random (its guesses refused), one whose MTP layer repeats the target's only
layer (it drafts what the target computes next: accepted). Either way greedy and seeded
answers, tokens and logprobs, equal the engine's without speculation, in every dtype this CPU
computes in; unseeded sampled requests are verified by rejection sampling; the layer's pool is
empty once everything has finished. V3's layer's logits equal those of transformers' MtpModel
(its `generate(use_mtp=True)` drafter) on the same checkpoint; V4's (transformers builds no V4
MTP) those of transformers' own V4 decoder layer, hyper-connection head and norm run over the
mixed streams (test_mtp_v4.py)."""

from __future__ import annotations

import pytest
import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.batch import ForwardBatch, SeqChunk
from services.model.errors import ModelLoadError
from services.model.loader import load_model, load_mtp
from services.model.loading.hf_config import mtp_layers
from services.settings import SpeculativeConfig
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.tiny_models import save_tiny_mtp, save_tiny_v4_mtp

MTP = SpeculativeConfig("mtp", num_tokens=3, max_batch=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, embedded_dir):
    made = {}
    for family, save in (("v3", save_tiny_mtp), ("v4", save_tiny_v4_mtp)):
        for kind in ("random", "copy"):
            made[family, kind] = tmp_path_factory.mktemp(f"mtp-{family}-{kind}")
            save(made[family, kind], embedded_dir, copy=kind == "copy")
    return made


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (30, 7, 50, 19)]


PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, logprobs=2),
    SamplingParams(max_tokens=24, temperature=0.8, seed=5, logprobs=2),
    SamplingParams(max_tokens=24, temperature=0.0),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=9, logprobs=1),
]


def drafting(path, dtype: str = "float32"):
    """The checkpoint loaded, its MTP layer, and an engine drafting with it."""
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    m = loaded.model
    mtp = load_mtp(path, loaded.config, m.dtype, m.device, m.kernels)
    config = EngineConfig(num_blocks=256, speculative=MTP)
    return loaded, mtp, Engine(m, loaded.tokenizer, config, draft=mtp)


def run(loaded, mtp, spec=MTP):
    engine = Engine(
        loaded.model, loaded.tokenizer, EngineConfig(num_blocks=256, speculative=spec), draft=mtp
    )
    out = engine.generate(prompts(), PARAMS)
    answers = [(c.token_ids, [lp.logprob for lp in c.logprobs]) for o in out for c in o.choices]
    return answers, engine


FAMILIES = pytest.mark.parametrize("family", ["v3", "v4"])


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("kind", ["random", "copy"])
@FAMILIES
def test_mtp_drafts_leave_greedy_and_seeded_answers_unchanged(checkpoints, family, kind, dtype):
    path = checkpoints[family, kind]
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    mtp = load_mtp(
        path, loaded.config, loaded.model.dtype, loaded.model.device, loaded.model.kernels
    )
    plain, _ = run(loaded, None, SpeculativeConfig())
    drafted, engine = run(loaded, mtp)
    assert drafted == plain
    stats = engine.speculator.stats
    print(f"{family} {kind} {dtype}: {stats.accepted} of {stats.proposed} proposed accepted")
    if kind == "copy":  # it drafts what the target computes: most kept
        assert stats.proposed >= 40 and stats.accepted >= 0.6 * stats.proposed
    else:  # random guesses: the adaptive length falls to 1 and pauses
        assert stats.accepted <= 0.2 * stats.proposed
    proposer = engine.speculator.proposer
    assert not proposer.states and proposer.blocks.num_free == 256  # everything given back


@FAMILIES
def test_unseeded_sampled_requests_verify_by_rejection_sampling(checkpoints, family):
    path = checkpoints[family, "copy"]
    loaded = load_model(str(path), dtype="float32", device="cpu")
    mtp = load_mtp(
        path, loaded.config, loaded.model.dtype, loaded.model.device, loaded.model.kernels
    )
    engine = Engine(
        loaded.model, loaded.tokenizer, EngineConfig(num_blocks=256, speculative=MTP), draft=mtp
    )
    params = SamplingParams(max_tokens=24, temperature=0.7)  # no seed: drawn from the layer's q
    out = engine.generate(prompts(), params)
    assert [len(o.choices[0].token_ids) for o in out] == [24] * 4
    stats = engine.speculator.stats
    assert stats.proposed > 0 and stats.accepted >= 0.5 * stats.proposed  # q close to p


def test_a_checkpoint_without_an_mtp_layer_is_refused(tiny_dir):
    path = tiny_dir("deepseek_v3")  # transformers declares one (num_nextn_predict_layers 1)
    loaded = load_model(str(path), dtype="float32", device="cpu")  # and saves no weights
    with pytest.raises(ModelLoadError, match=r"no MTP layer: model\.layers\.3\.eh_proj\.weight"):
        load_mtp(path, loaded.config, loaded.model.dtype, loaded.model.device, "auto")
    v4 = tiny_dir("deepseek_v4")  # the same: DeepSeek's `mtp.0.*` absent
    loaded = load_model(str(v4), dtype="float32", device="cpu")
    with pytest.raises(ModelLoadError, match=r"no MTP layer: mtp\.0\.e_proj\.weight"):
        load_mtp(v4, loaded.config, loaded.model.dtype, loaded.model.device, "auto")
    qwen = tiny_dir("qwen3_moe")
    assert mtp_layers(qwen) == 0
    loaded = load_model(str(qwen), dtype="float32", device="cpu")
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers"):
        load_mtp(qwen, loaded.config, loaded.model.dtype, loaded.model.device, "auto")


@FAMILIES
def test_a_layer_without_the_prompts_states_starts_at_the_first_it_has(checkpoints, family):
    """Hidden rows beyond max_waiting are dropped (a sequence that does not propose keeps its
    latest): the layer then starts at an origin past 0, answers unchanged, drafts accepted."""
    loaded, _, engine = drafting(checkpoints[family, "copy"])
    plain, _ = run(loaded, None, SpeculativeConfig())
    proposer = engine.speculator.proposer
    proposer.max_waiting = 16  # every prompt longer: its first rows are gone by the first draft
    origins = []
    propose = proposer.propose

    def watching(seqs, ks):
        out = propose(seqs, ks)
        origins.extend(proposer.states[(s.request_id, s.index)].origin for s in seqs)
        return out

    proposer.propose = watching
    out = engine.generate(prompts(), PARAMS)
    answers = [(c.token_ids, [lp.logprob for lp in c.logprobs]) for o in out for c in o.choices]
    assert answers == plain
    assert max(origins) > 0 and engine.speculator.stats.accepted > 0


def test_the_layers_logits_equal_transformers_mtp_model(checkpoints):
    """At every position of a prompt: the target's final hidden states, then the MTP layer over
    (token j + 1, h[j]) -> logits, ours against transformers' (float32)."""
    import transformers
    from transformers.modeling_layers import MtpModel

    path = checkpoints["v3", "random"]
    main = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = main.config.num_hidden_layers  # DeepseekV3 names layer 61 (the real V3's) as its MTP
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    reference = MtpModel.from_pretrained(main).eval()
    tokens = prompts()[2]
    with torch.no_grad():
        h = main(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(1, len(tokens))[None]
        rows = reference.forward_layer(
            0, h[:, :-1], positions, None, input_ids=torch.tensor([tokens[1:]])
        )
        expected = reference._project_to_logits(rows)[0]

    loaded = load_model(str(path), dtype="float32", device="cpu")
    mtp = load_mtp(
        path, loaded.config, loaded.model.dtype, loaded.model.device, loaded.model.kernels
    )
    blocks = list(range(4))
    loaded.model.keep_hidden = True  # as the engine sets it for --speculative mtp
    batch = ForwardBatch.build([SeqChunk(tokens, 0, blocks, all_logits=True)], 16, "cpu")
    loaded.model.forward(batch, loaded.model.new_kv_cache(4, 16))
    shifted = ForwardBatch.build([SeqChunk(tokens[1:], 0, blocks, all_logits=True)], 16, "cpu")
    logits, _ = mtp.forward(shifted, mtp.new_kv_cache(4, 16), loaded.model.hidden[:-1])
    assert torch.allclose(logits, expected, atol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@FAMILIES
def test_a_layer_short_of_blocks_drafts_less_and_changes_nothing(checkpoints, family):
    """The layer's pool holds 3 blocks (48 tokens): the 50-token prompt's catch-up cannot be
    reserved, so its state starts afresh each time; the others draft; answers unchanged and
    every block given back."""
    from services.engine.mtp_proposer import MtpProposer

    loaded, mtp, engine = drafting(checkpoints[family, "copy"])
    plain, _ = run(loaded, None, SpeculativeConfig())
    small = engine.speculator.proposer = MtpProposer(mtp, loaded.config.vocab_size, 3, 16)
    out = engine.generate(prompts(), PARAMS)
    answers = [(c.token_ids, [lp.logprob for lp in c.logprobs]) for o in out for c in o.choices]
    assert answers == plain
    assert engine.speculator.stats.accepted > 0 and small.blocks.num_free == 3
