"""DeepSeek-V3.2 (services/model/families/deepseek_v32/) against transformers' own: after a
prefill the paged cache holds transformers' cache state (each layer's latent and rotary key, and
the lightning indexer's keys, a cache group of their own), and the indexer's choice is what each
query reads: the same checkpoint with index_topk raised past the context answers otherwise, and
again as transformers does. test_families.py compares greedy tokens and bfloat16 logits;
tests/decode/test_families_e2e.py serves it disaggregated over Redis."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model import kv_cache
from services.model.batch import ForwardBatch, SeqChunk
from services.model.families.deepseek_v32.config import INDEXER, LATENT, v32_of
from services.model.loader import load_model
from tests.support.tiny_models import VOCAB, save_tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("deepseek_v32")
    return path, save_tiny("deepseek_v32", path, embedded_dir)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_after_a_prefill_the_cache_holds_transformers_latents_and_indexer_keys(checkpoint):
    path, reference = checkpoint
    loaded = load_model(str(path), dtype="float32", device="cpu")
    model, config = loaded.model, loaded.config
    ids, table = prompt(40), [2, 0, 1]  # blocks out of order
    kv = model.new_kv_cache(3, 16)
    model.forward(ForwardBatch.build([SeqChunk(ids, 0, table)], 16), kv)
    with torch.inference_mode():
        cache = reference(torch.tensor([ids]), use_cache=True).past_key_values
    index = torch.tensor(table)
    shape = v32_of(config)
    for i, theirs in enumerate(cache.layers):
        latents, _ = kv_cache.gather(*kv.group(LATENT).layer(i), index)  # [48, 1, 40]
        keys, _ = kv_cache.gather(*kv.group(INDEXER).layer(i), index)  # [48, 1, 16]
        c, k_rot = latents[:40, 0].split([shape.kv_lora_rank, shape.rope_dim], dim=-1)
        assert torch.allclose(c, theirs.keys[0, 0], atol=1e-5, rtol=1e-4)
        assert torch.allclose(k_rot, theirs.values[0, 0], atol=1e-5, rtol=1e-4)
        assert torch.allclose(keys[:40, 0], theirs.indexer_keys[0], atol=1e-5, rtol=1e-4)


def test_the_indexer_chooses_what_each_query_reads(checkpoint, tmp_path):
    """index_topk 8 against 512 (every earlier token): other tokens, each as transformers'."""
    path, reference = checkpoint
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"index_topk": 512}))
    dense_reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompts = [prompt(60, seed=3), prompt(33, seed=4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    answers = []
    for where, theirs in ((path, reference), (tmp_path, dense_reference)):
        loaded = load_model(str(where), dtype="float32", device="cpu")
        engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=32))
        ours = [o.choices[0].token_ids for o in engine.generate(prompts, params)]
        for p, tokens in zip(prompts, ours, strict=True):
            with torch.inference_mode():
                expected = theirs.generate(
                    torch.tensor([p]),
                    max_new_tokens=16,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
            assert tokens == expected
        answers.append(ours)
    assert answers[0] != answers[1]


def test_a_chunked_prompt_and_a_cached_prefix_give_the_tokens_of_one_pass(checkpoint):
    """The indexer's keys of earlier chunks, and of a prefix found in the prefix cache, are
    read back from the cache: the same tokens as the prompt computed in one pass."""
    path, _ = checkpoint
    loaded = load_model(str(path), dtype="float32", device="cpu")
    ids = prompt(70, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(**config) -> list[int]:
        engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=32, **config))
        return engine.generate([ids], params)[0].choices[0].token_ids

    whole = run(max_num_batched_tokens=256)
    assert run(max_num_batched_tokens=256, prefill_chunk_size=16) == whole
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=32))
    engine.generate([ids[:64]], SamplingParams(max_tokens=1))  # leaves 4 blocks cached
    before = engine.blocks.hits
    assert engine.generate([ids], params)[0].choices[0].token_ids == whole
    assert engine.blocks.hits - before == 4
