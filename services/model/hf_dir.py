"""Read a Hugging Face checkpoint directory's weights: (sharded) safetensors (config.json:
hf_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.weights import check_complete, check_shapes


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(index, f"not a safetensors index: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f, "listed in model.safetensors.index.json but missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors files in the model directory")
    return files


def read_weights(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor the config calls for, as stored (dtype unchanged; FP8 weights dequantized
    to float32 with their block scales), shape-checked."""
    from safetensors import safe_open

    wanted = set(config.expected_shapes())
    if config.fp8_block is not None:
        wanted |= {name + SCALE for name in wanted if name.endswith(".weight")}
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                # e.g. rotary inv_freq buffers or a tied lm_head copy are skipped
                tensors = {name: f.get_tensor(name) for name in f.keys() if name in wanted}  # noqa: SIM118
        except Exception as e:  # safetensors raises several types for a bad header
            raise ModelLoadError(file, f"not a valid safetensors file: {e}") from e
        check_shapes(file, config, {name: t.shape for name, t in tensors.items()})
        out |= tensors
    check_complete(path, config, out)
    if config.fp8_block is not None:
        out = dequantized(path, out, config.fp8_block)
    return out


SCALE = "_scale_inv"  # a weight's FP8 block scales: `<name>.weight_scale_inv`


def dequantized(
    path: Path, tensors: dict[str, torch.Tensor], block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """FP8 (e4m3) weights times their block scales [ceil(out / b0), ceil(in / b1)], in float32;
    the other tensors as they are, the scales dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t
            continue
        scale = tensors.get(name + SCALE)
        rows, cols = t.shape
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if scale is None or tuple(scale.shape) != want:
            got = None if scale is None else tuple(scale.shape)
            raise ModelLoadError(path, f"{name}{SCALE}: shape {got}, FP8 blocks need {want}")
        expanded = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        out[name] = t.float() * expanded[:rows, :cols]
    return out
