"""Checkpoints of the MoE and latent-attention families, made by transformers, load and match it
token for token: DeepSeek-V3 with and without MoE layers, DeepSeek-V3.2 (its lightning indexer
picking 8 earlier tokens per query), DeepSeek-V2 (no q LoRA), DeepSeek-V4
(every layer type, both MoE kinds), gpt-oss (sliding and full layers, sinks), Gemma 3 (local
and global layers, softcaps), Mixtral, Qwen2-MoE, Qwen3-MoE and Qwen3."""

from __future__ import annotations

import json

import pytest
import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model import families
from services.model.batch import ForwardBatch, SeqChunk
from services.model.errors import ModelLoadError
from services.model.families.deepseek.config import MlaShape
from services.model.families.deepseek_v4.config import V4Shape
from services.model.loader import load_model
from services.model.loading.hf_config import read_config
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.tiny_models import ARCHITECTURE, FAMILIES, VOCAB, save_tiny


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny(request.param, path, embedded_dir)


PICKS_KEYS = ("deepseek_v32",)  # an indexer picks the keys of each query, by a top-k


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (40, 17, 5)]


def reference_tokens(reference, prompt: list[int], n: int):
    with torch.inference_mode():
        return reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )


def test_config_reads_the_family(checkpoint):
    name, path, reference = checkpoint
    cfg = read_config(path)
    assert cfg.architecture == ARCHITECTURE.get(name, name)
    latent = name in ("deepseek_v2", "deepseek_v3", "deepseek_v3_dense", "deepseek_v32")
    assert isinstance(cfg.shape, MlaShape) == latent
    assert isinstance(cfg.shape, V4Shape) == (name == "deepseek_v4")
    moe_layers = {"deepseek_v3": (1, 2), "deepseek_v3_dense": (), "deepseek_v2": (1, 2),
                  "deepseek_v32": (1, 2),
                  "mixtral": (0, 1, 2), "qwen2_moe": (0, 2), "qwen3_moe": (0, 1, 2),
                  "deepseek_v4": (0, 1, 2, 3), "gpt_oss": (0, 1, 2)}  # fmt: skip
    assert (cfg.moe.layers if cfg.moe else ()) == moe_layers.get(name, ())
    buffers = ("e_score_correction_bias", "tid2eid")  # checkpoint tensors, not parameters
    assert families.num_parameters(cfg) == sum(p.numel() for p in reference.parameters()) + sum(
        b.numel() for n, b in reference.named_buffers() if n.endswith(buffers)
    )


def test_greedy_tokens_equal_transformers_over_24_tokens_on_3_prompts(checkpoint):
    name, path, reference = checkpoint
    loaded = load_model(str(path), dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=32))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    batched = [o.choices[0].token_ids for o in engine.generate(prompts(), params)]
    for prompt, ours in zip(prompts(), batched, strict=True):
        expected = reference_tokens(reference, prompt, 24)
        assert ours == expected.sequences[0, len(prompt) :].tolist(), name
    # the first step's logits, from a block table out of order
    prompt = prompts()[0]
    kv = loaded.model.new_kv_cache(3, 16)
    logits = loaded.model.forward(ForwardBatch.build([SeqChunk(prompt, 0, [2, 0, 1])], 16), kv)
    first = reference_tokens(reference, prompt, 1).logits[0][0]
    assert torch.allclose(logits[0], first, atol=1e-4, rtol=0), name


@pytest.mark.parametrize("dtype", [d for d in COMPUTE_DTYPES if d.id == "bfloat16"])
def test_bfloat16_logits_follow_transformers(checkpoint, dtype):
    """In bfloat16 both round differently; the logits agree as the Llama kernels' tests ask
    (2e-2 of their scale) and the first token is the same."""
    name, path, reference = checkpoint
    loaded = load_model(str(path), dtype=dtype, device="cpu")
    prompt = prompts()[0]
    kv = loaded.model.new_kv_cache(3, 16)
    ours = loaded.model.forward(ForwardBatch.build([SeqChunk(prompt, 0, [0, 1, 2])], 16), kv)[0]
    exact = reference_tokens(reference, prompt, 1).logits[0][0]
    bf16 = reference.to(torch.bfloat16)
    try:
        theirs = reference_tokens(bf16, prompt, 1).logits[0][0].float()
    finally:
        reference.to(torch.float32)
    if name in PICKS_KEYS:
        # which keys a query reads is a top-k of scores that bfloat16 rounds: the two pick
        # apart where scores are near, and each moves from float32 as far as the other
        theirs_off, ours_off = (theirs - exact).abs().max(), (ours - exact).abs().max()
        assert ours_off <= 1.5 * theirs_off + 2e-2 * exact.abs().max(), name
        return
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 2e-2 * scale + 2e-2, name
    assert int(ours.argmax()) == int(theirs.argmax()), name


@pytest.mark.parametrize(
    ("field", "value", "arch"),
    [
        ("scoring_func", "sqrtsoftplus", "DeepseekV3ForCausalLM"),
        ("topk_method", "group_limited_greedy", "DeepseekV3ForCausalLM"),
        ("topk_method", "noaux_tc", "DeepseekV2ForCausalLM"),
        ("topk_method", "random", "DeepseekV2ForCausalLM"),
        ("n_group", 3, "DeepseekV3ForCausalLM"),
        ("router_jitter_noise", 0.1, "MixtralForCausalLM"),
        ("use_sliding_window", True, "Qwen3MoeForCausalLM"),
        ("hidden_act", "gelu", "DeepseekV3ForCausalLM"),
        ("num_key_value_heads", 2, "DeepseekV4ForCausalLM"),
        ("scoring_func", "softmax", "DeepseekV4ForCausalLM"),
        ("o_groups", 3, "DeepseekV4ForCausalLM"),
        ("quantization_config", {"quant_method": "awq"}, "DeepseekV4ForCausalLM"),
        ("expert_dtype", "int4", "DeepseekV4ForCausalLM"),
        ("layer_types", ["sliding_attention", "full_attention"] * 2, "DeepseekV4ForCausalLM"),
        ("mlp_layer_types", ["moe", "dense"] * 2, "DeepseekV4ForCausalLM"),
        ("use_bidirectional_attention", True, "Gemma3ForCausalLM"),
        ("hidden_activation", "relu", "Gemma3ForCausalLM"),
    ],
)
def test_a_field_value_the_engine_does_not_implement_is_refused_by_name(
    tmp_path, field, value, arch
):
    families = {
        "DeepseekV3ForCausalLM": "deepseek_v3",
        "DeepseekV2ForCausalLM": "deepseek_v2",
        "MixtralForCausalLM": "mixtral",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "DeepseekV4ForCausalLM": "deepseek_v4",
        "Gemma3ForCausalLM": "gemma3",
    }
    config = FAMILIES[families[arch]]().to_dict() | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=field):
        read_config(tmp_path)
