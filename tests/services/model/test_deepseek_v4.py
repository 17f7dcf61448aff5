"""DeepSeek-V4's cache state in the paged pool (docs/structures.md): after a prefill, the rows
hold what transformers' cache holds (each layer's window, the compressed entries and indexer
keys, the compressors' open windows and CSA's overlap halves), so decode continues exactly.
Also: a config in the legacy spelling, with YaRN on the compress rope set and sigmoid scores,
matches transformers token for token; FP8 / FP4 checkpoints load; preemption changes no
token; the row layout of DeepSeek-V4-Flash's shape."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.batch import ForwardBatch, SeqChunk
from services.model.families.deepseek_v4 import quant as v4_quant
from services.model.families.deepseek_v4 import rows as v4_rows
from services.model.families.deepseek_v4.config import CSA, HCA, SLIDING, row_layout, v4_of
from services.model.families.deepseek_v4.model import DeepseekV4Model
from services.model.loader import load_model
from services.model.loading.hf_config import config_from_hf
from tests.support.tiny_models import V4, save_tiny

N = 53  # 13 CSA entries and one token open; 3 HCA entries and 5 tokens open; 7 blocks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("deepseek_v4")
    return path, save_tiny("deepseek_v4", path, embedded_dir)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_after_a_prefill_the_rows_hold_transformers_cache_state(checkpoint):
    path, reference = checkpoint
    loaded = load_model(str(path), dtype="float32", device="cpu")
    model = loaded.model
    assert isinstance(model, DeepseekV4Model)
    ids, table = prompt(N), torch.tensor([5, 2, 6, 0, 3, 1, 4])  # blocks out of order
    kv = model.new_kv_cache(8, 16)
    model.forward(ForwardBatch.build([SeqChunk(ids, 0, table.tolist())], 16), kv)
    with torch.inference_mode():
        cache = reference(torch.tensor([ids]), use_cache=True).past_key_values
    rows, pools = model.rows, v4_rows.Pools.of(kv)
    v4, d = model.v4, model.config.head_dim

    def read(positions: range, offset: int, width: int) -> torch.Tensor:
        slots = v4_rows.slots_of(table, torch.tensor(list(positions)), 16)
        return v4_rows.read(pools.window, slots, offset, width)

    def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        assert ours.shape == theirs.shape
        assert torch.allclose(ours, theirs.float(), atol=1e-5, rtol=1e-4)

    for i, kind in enumerate(v4.layer_types):
        layer, row = cache.layers[i], rows[i]
        window = range(N - (v4.window - 1), N)  # transformers keeps the last window - 1
        close(read(window, row.offset, d), layer.keys[0, 0])
        if kind == SLIDING:
            assert row.raw == row.share == 0
            continue
        m, series = v4.rate(i), 2 if kind == CSA else 1
        entries = model.attention._read_entries(
            row, _span(N, table), m, 16, pools, torch.arange(N // m)
        )  # [N // m, entry]
        close(entries[:, :d], layer.compressed_kv["compressor"][0])
        raw = row.offset + row.kv
        open_ = range(N - N % m, N)  # the open window: raw kv and gate (no position bias)
        close(read(open_, raw, series * d), layer.buffer_kv["compressor"][0])
        close(read(open_, raw + series * d, series * d), layer.buffer_gate["compressor"][0])
        if kind == HCA:
            continue
        closed = range((N // m - 1) * m, N // m * m)  # CSA: the last closed window's A half
        close(read(closed, raw, d), layer.overlap_kv["compressor"][0])
        bias = model.layers[i].attention.compressor
        assert bias is not None
        gate = read(closed, raw + 2 * d, d) + bias.bias[:, :d]
        close(gate, layer.overlap_gate["compressor"][0])
        close(entries[:, d:], layer.compressed_kv["indexer"][0])
        idx = raw + 4 * d  # the indexer's raw kv, then gate
        close(read(open_, idx, 2 * v4.index_dim), layer.buffer_kv["indexer"][0])


def _span(context: int, table: torch.Tensor):
    from services.model.batch import SeqSpan

    return SeqSpan(0, context, context, table)


def test_a_legacy_config_with_yarn_and_sigmoid_scores_matches_transformers(tmp_path, embedded_dir):
    """compress_ratios, num_hash_layers, qk_rope_head_dim and a flat YaRN rope_scaling (the
    compress set's), as DeepSeek's own config.json spells them."""
    modern = ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor")
    legacy = {k: v for k, v in V4.items() if k not in modern}
    legacy |= {
        "compress_ratios": [0, 4, 16, 4], "num_hash_layers": 1, "qk_rope_head_dim": 8,
        "compress_rate_hca": 16, "scoring_func": "sigmoid", "compress_rope_theta": 40000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    }  # fmt: skip
    legacy["compress_ratios"][2] = 128  # HCA's legacy marker; its rate comes from the field
    config = transformers.DeepseekV4Config(**legacy)
    torch.manual_seed(1)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters"):
        raw.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(raw | legacy))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_bytes((embedded_dir / file).read_bytes())
    ours = config_from_hf(raw | legacy)
    v4 = v4_of(ours)
    assert v4.layer_types == (SLIDING, CSA, HCA, CSA)
    assert v4.hash_layers == (0,) and v4.compress_yarn is not None
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert_greedy_equal(tmp_path, reference, [prompt(90, seed=1), prompt(41, seed=2)])


def assert_greedy_equal(path, reference, prompts: list[list[int]]) -> None:
    """24 greedy tokens of each prompt, batched through the engine (float32), equal
    transformers' generate."""
    loaded = load_model(str(path), dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for p, out in zip(prompts, engine.generate(prompts, params), strict=True):
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([p]),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert out.choices[0].token_ids == expected


def test_deepseek_v4_flash_rows():
    """A token's row per layer, in elements, for V4-Flash's shape (head 512, indexer 128,
    CSA every 4, HCA every 128): window key, compressor inputs, a share of an entry."""
    flash = config_from_hf({
        "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280, "hidden_size": 4096,
        "num_hidden_layers": 4, "num_attention_heads": 64, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "compress_ratios": [0, 4, 128, 4],
    })  # fmt: skip
    widths = [(r.kv, r.raw, r.share, r.span) for r in row_layout(v4_of(flash), flash.head_dim)]
    assert widths == [(512, 0, 0, 0), (512, 2560, 160, 4), (512, 1024, 32, 16), (512, 2560, 160, 4)]
    assert flash.cache_shape == (1, 512 + 3232 + 1568 + 3232, 0) and flash.cache_layers == 1


def test_fp8_and_fp4_checkpoints_load_as_their_dequantized_weights(checkpoint, tmp_path):
    """Dense products in FP8 with ue8m0 scales per 16 x 16 block, routed experts in FP4 (two
    e2m1 values a byte, a scale per 32 columns), scales spelled both ways: the model equals
    the one loaded from the dequantized weights in float32, bit for bit."""
    path, _ = checkpoint
    stored = load_file(path / "model.safetensors")
    quantized, plain = {}, {}
    for i, (name, t) in enumerate(sorted(stored.items())):
        base = name.removesuffix(".weight")
        scale = base + (".scale" if i % 2 else ".weight_scale_inv")
        routed = ".experts." in name and name.endswith(".weight")
        dense = name.endswith(".weight") and (".attn.w" in name or "shared_experts" in name)
        if routed:
            q, s = v4_quant.quantize_fp4(t)
        elif dense and "compressor" not in name and "indexer" not in name:
            q, s = v4_quant.quantize_fp8(t, (16, 16))
        else:
            quantized[name] = plain[name] = t
            continue
        quantized |= {name: q, scale: s}
        plain[name] = v4_quant.dequantize({name: q, base + ".scale": s}, name, (16, 16))
        assert not torch.equal(plain[name], t)  # quantizing changed it: the test can fail
    config = json.loads((path / "config.json").read_text())
    dirs = {
        "quantized": (
            quantized,
            config
            | {
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "scale_fmt": "ue8m0",
                    "weight_block_size": [16, 16],
                    "expert_dtype": "fp4",
                }
            },
        ),
        "plain": (plain, config),
    }
    logits = []
    for kind, (tensors, cfg) in dirs.items():
        out = tmp_path / kind
        out.mkdir()
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(cfg))
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (out / file).write_bytes((path / file).read_bytes())
        model = load_model(str(out), dtype="float32", device="cpu").model
        kv = model.new_kv_cache(4, 16)
        batch = ForwardBatch.build([SeqChunk(prompt(40), 0, [0, 1, 2])], 16)
        logits.append(model.forward(batch, kv))
    assert torch.equal(logits[0], logits[1])


def test_preempted_sequences_give_the_tokens_of_a_pool_with_room(checkpoint):
    """A pool too small for the batch preempts sequences (their rows released, recomputed
    later from the tokens): every answer equals the one computed without preemption."""
    path, _ = checkpoint
    loaded = load_model(str(path), dtype="float32", device="cpu")
    prompts = [prompt(40 + 9 * i, seed=30 + i) for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tight = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=14))
    squeezed = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    tight.check()
    roomy = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=128))
    expected = roomy.generate(prompts, params)
    assert roomy.scheduler.num_preemptions == 0
    for got, want in zip(squeezed, expected, strict=True):
        assert got.choices[0].token_ids == want.choices[0].token_ids


def test_greedy_tokens_equal_transformers_on_prompts_of_several_hca_windows(checkpoint):
    """24 greedy tokens on 3 prompts of 5 to 9 HCA windows (16 tokens each here), batched
    through the engine, equal transformers' (float32)."""
    path, reference = checkpoint
    assert_greedy_equal(path, reference, [prompt(n, seed=40 + n) for n in (83, 120, 150)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_reads_in_c_copy_the_bits_torch_reads(monkeypatch, dtype):
    """kernels/rows.c against the torch indexing it stands in for, in both pool layouts."""
    assert v4_rows._library() is not None, "kernels/rows.c did not build"
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(9, 1, 40, 16, generator=gen).to(dtype)
    slots = torch.randperm(9 * 16, generator=gen)[:50]
    parts = [(0, 40), (8, 12), (38, 2)]
    fast = [v4_rows.read(cache, slots, offset, width) for offset, width in parts]
    monkeypatch.setattr(v4_rows, "_library", lambda: None)
    for (offset, width), got in zip(parts, fast, strict=True):
        assert torch.equal(got, v4_rows.read(cache, slots, offset, width))
