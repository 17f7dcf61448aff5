"""DeepSeek-V4's MTP layer (families/deepseek/mtp.py, V4Mtp) against transformers' own V4 parts.

transformers builds no V4 MTP layer (it skips `mtp.*`), but it builds everything one is made
of: the checkpoint reloaded with one more decoder layer holding the MTP block's weights gives
transformers' decoder layer, and its hyper-connection head and norm take the MTP layer's own.
Over a prompt: the target's last streams H (its last layer's output), then

    x = e_proj(enorm(embed(t[j + 1])))[None] + h_proj(hnorm(H[j]))  -> layer -> head -> logits

at every position j, ours against that (float32). And as DeepSeek ships it (FP8 products with
block scales, the layer's e_proj and h_proj too; FP4 experts): the layer's logits equal those
of the same weights stored dequantized, bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)

from services.model.batch import ForwardBatch, SeqChunk
from services.model.errors import ModelLoadError
from services.model.families.deepseek_v4 import quant as v4_quant
from services.model.families.deepseek_v4.mtp import V4Mtp
from services.model.loader import load_model, load_mtp
from tests.support.tiny_models import save_tiny_v4_mtp


def with_mtp_as_last_layer(path, into):
    """The checkpoint with its MTP block as decoder layer N (what transformers loads)."""
    shutil.copytree(path, into)
    config = json.loads((into / "config.json").read_text())
    n = config["num_hidden_layers"]
    config["num_hidden_layers"] = n + 1
    config["layer_types"] = [*config["layer_types"], "sliding_attention"]
    config["mlp_layer_types"] = [*config["mlp_layer_types"], "moe"]
    (into / "config.json").write_text(json.dumps(config))
    mtp = load_file(str(into / "model-mtp.safetensors"))
    own = ("mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.enorm", "mtp.0.hnorm", "mtp.0.norm.",
           "mtp.0.hc_head")  # fmt: skip
    layer = {
        f"model.layers.{n}." + k.removeprefix("mtp.0."): t
        for k, t in mtp.items()
        if not k.startswith(own)
    }
    save_file(layer, str(into / "model-mtp.safetensors"))
    index = into / "model.safetensors.index.json"
    listed = json.loads(index.read_text())
    listed["weight_map"] = {k: f for k, f in listed["weight_map"].items() if "mtp." not in k}
    listed["weight_map"] |= dict.fromkeys(layer, "model-mtp.safetensors")
    index.write_text(json.dumps(listed))
    return mtp, n


def rms(x, weight, eps):
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_the_layers_logits_equal_transformers_v4_parts(tmp_path, embedded_dir):
    path = tmp_path / "v4-mtp"
    save_tiny_v4_mtp(path, embedded_dir, copy=False)
    target = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mtp, n = with_mtp_as_last_layer(path, tmp_path / "reference")
    holder = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "reference", dtype=torch.float32
    ).eval()
    c = holder.config
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(100, 40000, (50,), generator=g).tolist()

    last: list[torch.Tensor] = []
    target.model.layers[-1].register_forward_hook(lambda m, i, out: last.append(out))
    head = DeepseekV4HyperHead(c)
    norm = DeepseekV4RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
    with torch.no_grad():
        target(torch.tensor([tokens]))
        streams = last[0][:, :-1]  # [1, S - 1, N, hidden]: H[j]
        ids = torch.tensor([tokens[1:]])
        e = rms(target.model.embed_tokens(ids), mtp["mtp.0.enorm.weight"], c.rms_norm_eps)
        h = rms(streams, mtp["mtp.0.hnorm.weight"], c.rms_norm_eps)
        x = (e @ mtp["mtp.0.e_proj.weight"].T)[:, :, None] + h @ mtp["mtp.0.h_proj.weight"].T
        positions = torch.arange(len(tokens) - 1)[None]
        rotary = holder.model.rotary_emb
        position_embeddings = {
            kind: rotary(e, position_ids=positions, layer_type=kind)
            for kind in ("main", "compress")
        }
        mask = create_sliding_window_causal_mask(c, e, None, None, positions)
        out = holder.model.layers[n](
            x,
            position_embeddings=position_embeddings,
            position_ids=positions,
            attention_mask=mask,
            input_ids=ids,
        )
        head.hc_fn.copy_(mtp["mtp.0.hc_head_fn"])
        head.hc_base.copy_(mtp["mtp.0.hc_head_base"])
        head.hc_scale.copy_(mtp["mtp.0.hc_head_scale"])
        norm.weight.copy_(mtp["mtp.0.norm.weight"])
        expected = holder.lm_head(norm(head(out)))[0]

    loaded = load_model(str(path), dtype="float32", device="cpu")
    model = loaded.model
    layer = load_mtp(path, loaded.config, model.dtype, model.device, model.kernels)
    assert isinstance(layer, V4Mtp)
    model.keep_hidden = True  # as the engine sets it for --speculative mtp
    blocks = list(range(4))
    batch = ForwardBatch.build([SeqChunk(tokens, 0, blocks, all_logits=True)], 16, "cpu")
    model.forward(batch, model.new_kv_cache(4, 16))
    assert torch.allclose(model.hidden[:-1], streams[0].flatten(1), atol=1e-5)
    shifted = ForwardBatch.build([SeqChunk(tokens[1:], 0, blocks, all_logits=True)], 16, "cpu")
    logits, _ = layer.forward(shifted, layer.new_kv_cache(4, 16), model.hidden[:-1])
    assert torch.allclose(logits, expected, atol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def quantized_copy(path, into, fp8: bool):
    """The checkpoint as DeepSeek ships V4 (fp8: dense products FP8 per 16 x 16 block, routed
    experts FP4, scales spelled both ways, the MTP layer's e_proj and h_proj too) or those
    weights dequantized (not fp8): the two load to the same numbers."""
    into.mkdir()
    for file in ("model-main.safetensors", "model-mtp.safetensors"):
        stored, out = load_file(str(path / file)), {}
        for i, (name, t) in enumerate(sorted(stored.items())):
            base = name.removesuffix(".weight")
            routed = ".experts." in name and name.endswith(".weight")
            dense = (
                name.endswith(".weight")
                and "compressor" not in name
                and (
                    ".attn.w" in name
                    or "shared_experts" in name
                    or name.endswith("e_proj.weight")
                    or name.endswith("h_proj.weight")
                )
            )
            if not routed and not dense:
                out[name] = t
                continue
            q, s = v4_quant.quantize_fp4(t) if routed else v4_quant.quantize_fp8(t, (16, 16))
            if fp8:
                out |= {name: q, base + (".scale" if i % 2 else ".weight_scale_inv"): s}
            else:
                out[name] = v4_quant.dequantize({name: q, base + ".scale": s}, name, (16, 16))
        save_file(out, str(into / file))
    config = json.loads((path / "config.json").read_text())
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                         "scale_fmt": "ue8m0", "weight_block_size": [16, 16],
                                         "expert_dtype": "fp4"}  # fmt: skip
    (into / "config.json").write_text(json.dumps(config))
    listed = json.loads((path / "model.safetensors.index.json").read_text())
    names = {}
    for file in ("model-main.safetensors", "model-mtp.safetensors"):
        names |= dict.fromkeys(load_file(str(into / file)), file)
    listed["weight_map"] = names
    (into / "model.safetensors.index.json").write_text(json.dumps(listed))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / file, into / file)


def test_an_fp8_checkpoints_layer_equals_its_dequantized_weights(tmp_path, embedded_dir):
    path = tmp_path / "v4-mtp"
    save_tiny_v4_mtp(path, embedded_dir, copy=False)
    tokens = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = []
    for fp8 in (True, False):
        out = tmp_path / f"fp8-{fp8}"
        quantized_copy(path, out, fp8)
        loaded = load_model(str(out), dtype="float32", device="cpu")
        model = loaded.model
        layer = load_mtp(out, loaded.config, model.dtype, model.device, model.kernels)
        model.keep_hidden = True
        blocks = list(range(3))
        model.forward(
            ForwardBatch.build([SeqChunk(tokens, 0, blocks)], 16), model.new_kv_cache(3, 16)
        )
        shifted = ForwardBatch.build([SeqChunk(tokens[1:], 0, blocks, all_logits=True)], 16)
        logits.append(layer.forward(shifted, layer.new_kv_cache(3, 16), model.hidden[:-1])[0])
    assert torch.equal(logits[0], logits[1])


def test_a_malformed_layer_is_refused_naming_the_tensor(tmp_path, embedded_dir):
    path = tmp_path / "v4-mtp"
    save_tiny_v4_mtp(path, embedded_dir, copy=False)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    model, stored = loaded.model, load_file(str(path / "model-mtp.safetensors"))
    broken = {
        "shape": stored | {"mtp.0.h_proj.weight": torch.zeros(64, 32)},
        "missing": {k: t for k, t in stored.items() if k != "mtp.0.attn.wq_a.weight"},
    }
    why = {
        "shape": r"tensor 'h_proj\.weight' has shape \(64, 32\)",
        "missing": r"tensor 'layers\.0\.attn\.wq_a\.weight' is missing",
    }
    for kind, tensors in broken.items():
        save_file(tensors, str(path / "model-mtp.safetensors"))
        with pytest.raises(ModelLoadError, match=r"the MTP layer \(mtp\.0\.\*\): " + why[kind]):
            load_mtp(path, loaded.config, model.dtype, model.device, model.kernels)
