"""GGUF reading: dequantization, llama.cpp's q/k permutation undone, the embedded model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from services.model.families.llama.gguf import read_gguf
from services.model.loader import load_model
from services.model.loading import sources
from tests.services.model.gguf_files import write_llama_gguf

Q = gguf.GGMLQuantizationType
TOKENIZER_KEYS = (
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.chat_template",
)


@pytest.fixture(scope="session")
def tokenizer_md():
    reader = gguf.GGUFReader(str(sources.embedded_gguf()))
    return {k: reader.fields[k].contents() for k in TOKENIZER_KEYS}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_tiny_gguf_matches_the_model_it_came_from(tmp_path, tiny_llama, tokenizer_md):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_llama, tokenizer_md)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.num_kv_heads == 2 and loaded.config.tie_word_embeddings
    ids = loaded.tokenizer.encode("The permutation of q and k rows is undone.")
    from services.model.batch import ForwardBatch, SeqChunk

    logits = loaded.model.forward(
        ForwardBatch.build([SeqChunk(ids, 0, [0])], 16), loaded.model.new_kv_cache(1)
    )
    with torch.inference_mode():
        expected = tiny_llama(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(logits[0], expected, atol=1e-5, rtol=0)


def _ref_q8_0(blob: np.ndarray) -> np.ndarray:
    blocks = blob.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(-1)


def _ref_q4_1(blob: np.ndarray) -> np.ndarray:
    blocks = blob.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1)


@pytest.mark.parametrize(
    ("kind", "reference", "bound"),
    [
        (Q.Q8_0, _ref_q8_0, 0.02),
        (Q.Q4_1, _ref_q4_1, 0.2),
        (Q.Q4_0, None, 0.3),
        (Q.Q5_0, None, 0.15),
        (Q.Q5_1, None, 0.1),
        (Q.F16, None, 1e-3),
        (Q.BF16, None, 1e-2),
    ],
)
def test_dequantization(tmp_path, tiny_llama, kind, reference, bound):
    name = "blk.0.ffn_down.weight"
    hf = "model.layers.0.mlp.down_proj.weight"
    path = tmp_path / f"{kind.name}.gguf"
    write_llama_gguf(path, tiny_llama, None, types={name: kind})
    got = read_gguf(path).tensors[hf]
    original = tiny_llama.state_dict()[hf].numpy()
    assert got.shape == original.shape and got.dtype == np.float32
    if reference is not None:  # bit-exact against an independent decoding of the blocks
        blob = gguf.quants.quantize(original, kind)
        assert np.array_equal(got.reshape(-1), reference(blob))
    scale = np.abs(original).max()
    assert np.abs(got - original).max() <= bound * scale


def test_embedded_weights_equal_transformers_gguf_loader(embedded_dir):
    """transformers reads the GGUF itself (its own dequantization and un-permutation)."""
    gguf_path = sources.embedded_gguf()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    ours = load_file(str(embedded_dir / "model.safetensors"))
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_conversion_is_cached(tmp_path, tiny_llama, tokenizer_md, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_llama, tokenizer_md)
    first = sources.resolve(str(path))
    assert first.parent == tmp_path / "cache"
    assert first.name.startswith("gguf-" + sources.file_sha256(path)[:32])

    def fail(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(sources, "write_hf_dir", fail)
    assert sources.resolve(str(path)) == first
