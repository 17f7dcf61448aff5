"""The whole engine with `--kernels triton` (Triton's attention and layer ops; on this CPU in
Triton's interpreter) on a small random Llama made here: the same greedy tokens as the
default kernels, and the same seeded sampled tokens, in every dtype `--dtype auto` may pick
on this CPU; the pool is empty afterwards.

In float32 the tokens are equal. In bfloat16 the two attentions (C's exp2 polynomial and
lane order, Triton's tiles) round an output element differently now and then, one bf16 ulp,
and a seeded draw near a boundary of the distribution can then go the other way: there, as
vLLM compares kernels in bf16, the outputs are equal up to a first divergence at which each
side's token is among the other's 5 most likely."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from services.engine.engine import Engine, EngineConfig
from services.engine.graphs import fill, static_batch
from services.engine.params import SamplingParams
from services.model.batch import ForwardBatch, SeqChunk
from services.model.kernels.gpu.attention import TritonAttention
from services.model.kernels.gpu.layer_ops import TritonLayerOps
from services.model.loader import load_model
from tests.support.dtypes import COMPUTE_DTYPES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_dir):
    """2 layers, GQA (6 query heads on 2 KV heads, head dim 32), a 64-token vocabulary
    (the embedded tokenizer's first 64 ids), its head scaled so distributions are peaked."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded_dir / f, path / f)
    return path


# prompts across block edges (16 tokens a block), one sharing another's first block
PROMPTS = [[5 + (i * 7 + j * 3) % 50 for j in range(9 + 5 * i)] for i in range(4)]
PROMPTS.append([*PROMPTS[3][:16], 40, 41])


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_triton_kernels_give_the_default_kernels_tokens(model_dir, dtype):
    outputs = {}
    for kernels in ("auto", "triton"):
        loaded = load_model(str(model_dir), dtype=dtype, device="cpu", kernels=kernels)
        if kernels == "triton":
            assert isinstance(loaded.model.attention, TritonAttention)
            assert isinstance(loaded.model.ops, TritonLayerOps)
        # a small budget: prompts are chunked, decodes batched with chunks
        config = EngineConfig(num_blocks=40, max_num_batched_tokens=24, prefill_chunk_size=16)
        engine = Engine(loaded.model, loaded.tokenizer, config)
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
        seeded = SamplingParams(
            max_tokens=8, temperature=0.8, top_p=0.9, seed=7, n=2, ignore_eos=True, logprobs=5
        )
        outputs[kernels] = [
            choice
            for out in engine.generate([*PROMPTS, *PROMPTS[:2]], [greedy] * 5 + [seeded] * 2)
            for choice in out.choices
        ]
        engine.check()
        assert engine.blocks.referenced_blocks() == 0
    tokens = {k: [c.token_ids for c in choices] for k, choices in outputs.items()}
    assert len({tuple(t) for t in tokens["auto"]}) > 4  # not one repeated token
    if dtype == "float32":
        assert tokens["triton"] == tokens["auto"]
    else:
        for triton, auto in zip(outputs["triton"], outputs["auto"], strict=True):
            assert_equal_up_to_a_near_tie(triton, auto)


def assert_equal_up_to_a_near_tie(a, b, k: int = 5) -> None:
    """a's and b's tokens are equal, or equal up to a position where each one's token is among
    the other's k most likely (after which they follow different texts), or, for a sampled
    token, where both saw the same distribution (the same k most likely, each logprob within
    0.05: the seeded draw fell at an edge between two tokens)."""
    assert len(a.token_ids) == len(b.token_ids)
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
        if x != y:
            top_a, top_b = a.logprobs[i].top[:k], b.logprobs[i].top[:k]
            tokens_a, tokens_b = [t for t, _ in top_a], [t for t, _ in top_b]
            if x in tokens_b and y in tokens_a:
                return
            same = tokens_a == tokens_b
            same &= all(abs(p - q) < 0.05 for (_, p), (_, q) in zip(top_a, top_b, strict=True))
            assert same, (i, a.token_ids, b.token_ids, top_a, top_b)
            return


def test_a_cuda_graphs_padded_inputs_give_the_eager_steps_logits(model_dir):
    """What a CUDA graph replays (graphs.py), run eagerly here: a decode step copied into the
    first rows of a larger static batch (padding: slot -1, context 0) gives the step's own
    logits, and its padding writes no KV."""
    loaded = load_model(str(model_dir), dtype="float32", device="cpu", kernels="triton")
    model = loaded.model
    kv = model.new_kv_cache(12)
    prompts = [SeqChunk(PROMPTS[1], 0, [3, 7]), SeqChunk(PROMPTS[2], 0, [1, 9])]
    model.forward(ForwardBatch.build(prompts, 16), kv)
    step = ForwardBatch.build(
        [SeqChunk([9], len(PROMPTS[1]), [3, 7]), SeqChunk([4], len(PROMPTS[2]), [1, 9])], 16
    )
    before = kv.k.clone(), kv.v.clone()
    eager = model.forward(step, kv)
    after = kv.k.clone(), kv.v.clone()
    kv.k.copy_(before[0])
    kv.v.copy_(before[1])
    static = static_batch(4, max_blocks=4, block_size=16, device=torch.device("cpu"))
    fill(static, step)
    replayed = model.forward(static, kv)
    assert replayed.shape == (4, 64)
    assert (replayed[:2] - eager).abs().max().item() < 1e-5
    assert torch.equal(kv.k, after[0]) and torch.equal(kv.v, after[1])
