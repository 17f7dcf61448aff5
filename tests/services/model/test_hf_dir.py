"""Hugging Face checkpoints of each supported architecture load and match transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.loader import load_model
from services.model.loading.hf_config import read_config
from services.model.loading.hf_dir import safetensors_files

TINY = dict(
    vocab_size=49152,  # the embedded tokenizer's, so its files can be reused
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
ARCHITECTURES = {
    # llama3 frequency scaling with a short original context, so it changes the result
    "llama": lambda: transformers.LlamaConfig(
        **TINY,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny_checkpoint(request, tmp_path_factory, embedded_dir):
    torch.manual_seed(0)
    config = ARCHITECTURES[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves biases at zero; make Qwen2's matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, max_shard_size="1MB")  # sharded, with an index
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded_dir / name, path / name)
    return request.param, path, model


def test_checkpoint_is_sharded(tiny_checkpoint):
    _, path, _ = tiny_checkpoint
    assert (path / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(path)) > 1


def test_config_fields(tiny_checkpoint):
    arch, path, model = tiny_checkpoint
    cfg = read_config(path)
    assert cfg.architecture == arch
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    assert (cfg.rope_scaling is not None) == (arch == "llama")


def test_logits_and_greedy_tokens_match(tiny_checkpoint):
    arch, path, reference = tiny_checkpoint
    loaded = load_model(str(path), dtype="float32", device="cpu")
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, 40, dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=8))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = engine.generate([prompt], params)[0].choices[0].token_ids
    assert ours == expected.sequences[0, 40:].tolist(), arch
    from services.model.batch import ForwardBatch, SeqChunk

    kv = loaded.model.new_kv_cache(3, 16)
    logits = loaded.model.forward(ForwardBatch.build([SeqChunk(prompt, 0, [2, 0, 1])], 16), kv)
    assert torch.allclose(logits[0], expected.logits[0][0], atol=1e-4, rtol=0)


def test_transformers5_rope_parameters_and_legacy_keys_agree(tmp_path):
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        **TINY,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    a = read_config(tmp_path)
    modern = dict(legacy, rope_theta=None, rope_scaling=None)
    modern["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(modern))
    assert read_config(tmp_path) == a
    assert a.rope_theta == 500000.0 and a.rope_scaling is not None
