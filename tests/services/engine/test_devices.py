"""Every tensor a step uses lives on the model's device: the batch builder, a full forward
step and the sampler run on the `meta` device (shapes, no data), where mixing in a tensor
made on the CPU raises. A device mix-up then fails here, not at a user's first GPU token."""

from __future__ import annotations

import pytest
import torch

from services.engine.params import SamplingParams
from services.engine.request import Sequence
from services.engine.sampler import Sampler
from services.model.batch import ForwardBatch, SeqChunk
from services.model.loader import load_model

META = torch.device("meta")


def test_a_cpu_tensor_mixed_into_meta_arithmetic_raises():
    """What the tests below rely on: the mix-up is an error on `meta`, as on a GPU."""
    with pytest.raises(RuntimeError, match="not on the expected device meta"):
        _ = torch.ones(3, 4, device=META) / torch.ones(3, 1)


def test_a_forward_step_on_the_meta_device(embedded_dir):
    loaded = load_model(str(embedded_dir), dtype="float32", device="meta")
    model = loaded.model
    assert model.embed.device == META and model.kernels == "torch"
    kv = model.new_kv_cache(8)
    chunks = [SeqChunk(list(range(20)), 0, [3, 1]), SeqChunk([5], 30, [0, 2]),
              SeqChunk([7, 8, 9], 16, [4, 5], all_logits=True)]  # fmt: skip
    batch = ForwardBatch.build(chunks, 16, META)
    assert all(t.device == META for t in (batch.token_ids, batch.block_tables, batch.seq_rows))
    logits = model.forward(batch, kv)
    assert logits.device == META and logits.shape == (5, model.config.vocab_size)


def seq(params: SamplingParams, output: tuple[int, ...] = ()) -> Sequence:
    tokens = [1, 2, 3, *output]
    return Sequence("r", 0, 3, tokens, params, 11, 0)


def test_the_sampler_on_the_meta_device():
    vocab = 50
    sampler = Sampler(vocab, eos_token_ids=[2])
    penalised = SamplingParams(
        temperature=1.0,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={4: 2.0},
        min_tokens=3,
        logprobs=2,
    )
    seqs = [
        seq(SamplingParams(temperature=0)),
        seq(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=1)),
        seq(penalised, output=(4, 5)),
        seq(SamplingParams(temperature=0.9, seed=2)),
    ]
    ahead = [(), (), (6,), ()]  # a row verifying a proposed token
    logits = torch.empty(len(seqs), vocab, device=META)
    tokens = sampler.choose(logits, seqs, ahead)
    assert tokens.device == META and tokens.shape == (4,) and tokens.dtype == torch.int64
    assert sampler.distributions(logits[1:], seqs[1:], ahead[1:]).device == META
