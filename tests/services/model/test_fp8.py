"""DeepSeek's FP8 checkpoints (e4m3 weights, float32 scales per block: weight_scale_inv,
quantization_config.weight_block_size) load dequantized. The test quantizes a tiny DeepSeek-V3
itself, with 16 x 16 blocks (some cut short by the matrix's edge)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model.batch import ForwardBatch, SeqChunk
from services.model.errors import ModelLoadError
from services.model.loader import load_model
from services.model.loading.hf_config import read_config
from tests.support.tiny_models import VOCAB, save_tiny

BLOCK = (16, 16)
FP8_MAX = 448.0


def quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and scales [ceil(rows / b0), ceil(cols / b1)]: each block's max -> 448."""
    rows, cols = w.shape
    br, bc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(br * block[0], bc * block[1])
    padded[:rows, :cols] = w
    blocks = padded.view(br, block[0], bc, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)  # [br, bc]
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def quantized_ones(name: str, t: torch.Tensor) -> bool:
    """As DeepSeek's: the layers' matrices, not norms, routers or embeddings."""
    return t.dim() == 2 and ".layers." in name and not name.endswith("gate.weight")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, embedded_dir):
    """(fp8 dir, the same weights dequantized in a plain dir, the original dir)."""
    plain = tmp_path_factory.mktemp("original")
    save_tiny("deepseek_v3", plain, embedded_dir)
    tensors = load_file(plain / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if quantized_ones(name, t):
            q, scale = quantize(t)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
            rows, cols = t.shape
            full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[:rows, :cols]
            dequantized[name] = q.float() * full
        else:
            fp8[name] = dequantized[name] = t
    dirs = []
    for label, weights in (("fp8", fp8), ("dequantized", dequantized)):
        path = tmp_path_factory.mktemp(label)
        for f in plain.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, path / f.name)
        save_file(weights, path / "model.safetensors")
        dirs.append(path)
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [16, 16],
    }  # fmt: skip
    (dirs[0] / "config.json").write_text(json.dumps(config))
    return dirs[0], dirs[1], plain


def logits(path, prompt: list[int]) -> torch.Tensor:
    model = load_model(str(path), dtype="float32", device="cpu").model
    kv = model.new_kv_cache(4, 16)
    return model.forward(ForwardBatch.build([SeqChunk(prompt, 0, [0, 1, 2, 3])], 16), kv)[0]


def test_an_fp8_checkpoint_computes_as_its_weights_dequantized(checkpoints):
    fp8, dequantized, original = checkpoints
    assert read_config(fp8).fp8_block == BLOCK
    prompt = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    got = logits(fp8, prompt)
    assert torch.equal(got, logits(dequantized, prompt))
    unquantized = logits(original, prompt)  # e4m3 keeps 3 mantissa bits: close, not equal
    assert not torch.equal(got, unquantized)
    assert (got - unquantized).abs().max() <= 0.05 * unquantized.abs().max()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "gptq"}, "quant_method"),
        ({"fmt": "e5m2"}, "fmt"),
        ({"weight_block_size": None}, "weight_block_size"),
    ],
)
def test_other_quantizations_are_refused_by_name(checkpoints, tmp_path, change, message):
    fp8, _, _ = checkpoints
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] |= change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        read_config(tmp_path)
