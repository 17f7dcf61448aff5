"""A checkpoint that cannot load gives one error line naming the file and the problem."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest

from services.cli import main
from tests.services.model.gguf_files import write_llama_gguf


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _error(capsys, model: str) -> str:
    """Run `pdserve generate` on `model`; return its only stderr line, checking exit code 2."""
    capsys.readouterr()  # drop what the test's own set-up printed
    assert main(["generate", "--prompt", "hello", "--model", model]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pdserve: error: ")
    return lines[0].removeprefix("pdserve: error: ")


def test_missing_path(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    assert _error(capsys, str(missing)) == f"{missing}: no such file or directory"


def test_file_that_is_neither_gguf_nor_safetensors(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("just some text\n")
    assert _error(capsys, str(path)) == (
        f"{path}: not a GGUF or safetensors file, nor a model directory"
    )


def test_truncated_gguf(tmp_path, tiny_llama, capsys):
    path = tmp_path / "cut.gguf"
    write_llama_gguf(path, tiny_llama, None)
    path.write_bytes(path.read_bytes()[:5000])
    assert _error(capsys, str(path)).startswith(f"{path}: corrupt GGUF: ")


def test_garbage_safetensors(tmp_path, tiny_llama, capsys, embedded_dir):
    tiny_llama.config.save_pretrained(tmp_path)
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    msg = _error(capsys, str(tmp_path / "model.safetensors"))
    assert msg.startswith(f"{tmp_path / 'model.safetensors'}: not a valid safetensors file")


def test_unsupported_gguf_architecture(tmp_path, tiny_llama, capsys):
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(path, tiny_llama, None, arch="gpt2")
    assert _error(capsys, str(path)) == (
        f"{path}: unsupported architecture 'gpt2' (supported: llama, mistral, qwen2)"
    )


def test_unsupported_hf_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    msg = _error(capsys, str(tmp_path))
    assert msg.startswith(
        f"{tmp_path / 'config.json'}: unsupported architecture ['GPT2LMHeadModel']"
    )


def test_unsupported_quantization_type(tmp_path, tiny_llama, capsys):
    path = tmp_path / "iq4.gguf"
    blob = np.zeros(36, dtype=np.uint8)  # 64 values = two IQ4_NL blocks of 18 bytes
    raw = {"blk.0.attn_norm.weight": (blob, gguf.GGMLQuantizationType.IQ4_NL)}
    write_llama_gguf(path, tiny_llama, None, raw=raw)
    msg = _error(capsys, str(path))
    assert msg.startswith(
        f"{path}: tensor 'blk.0.attn_norm.weight' has unsupported quantization type IQ4_NL"
    )


def test_gguf_tensor_shape_disagrees_with_metadata(tmp_path, tiny_llama, capsys):
    path = tmp_path / "wide.gguf"
    write_llama_gguf(path, tiny_llama, None, overrides={"feed_forward_length": 100})
    assert _error(capsys, str(path)) == (
        f"{path}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape (128, 64), "
        "the config implies (100, 64)"
    )


def test_hf_tensor_shape_disagrees_with_config(tmp_path, tiny_llama, capsys, embedded_dir):
    tiny_llama.save_pretrained(tmp_path)
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _error(capsys, str(tmp_path)) == (
        f"{tmp_path / 'model.safetensors'}: tensor 'model.layers.0.mlp.down_proj.weight' has "
        "shape (64, 128), the config implies (64, 100)"
    )


def test_missing_tensor(tmp_path, tiny_llama, capsys, embedded_dir):
    state = tiny_llama.state_dict()
    state = {k: v for k, v in state.items() if "layers.1.mlp" not in k and k != "lm_head.weight"}
    tiny_llama.config.save_pretrained(tmp_path)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    assert _error(capsys, str(tmp_path)) == (
        f"{tmp_path}: tensor 'model.layers.1.mlp.down_proj.weight' is missing and 2 more"
    )
