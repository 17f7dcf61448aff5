"""Read a Hugging Face checkpoint directory's weights: (sharded) safetensors (config.json:
hf_config.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from services.model import families
from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.loading.hf_config import mtp_layers
from services.model.loading.weights import check_complete, check_shapes


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


class Weights(dict[str, torch.Tensor]):
    """A checkpoint's tensors by (canonical) name. Once the model is built, `release()` drops
    them; a tensor asked for after that is read from its file again, and not kept (an expert
    built for another slot while serving: parallel/exchange.py). `experts`: the routed
    experts this process holds a share of, the only ones read at load and built (None:
    all); the others' tensors are read should a slot take them later."""

    def __init__(
        self, files: dict[str, tuple[Path, str]], experts: frozenset[int] | None = None
    ) -> None:
        super().__init__()
        self.files = files  # name -> (its file, its name there)
        self.experts = experts

    def release(self) -> None:
        self.clear()

    def __missing__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file, stored = self.files[name]  # KeyError: not in the checkpoint
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(stored)

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or name in self.files

    def get(  # type: ignore[override]
        self, name: str, default: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if name in self:  # (dict.get would not read a released tensor)
            return self[name]
        return default


def read_weights(
    path: Path,
    config: ModelConfig,
    rows: Mapping[str, slice] | None = None,
    experts: frozenset[int] | None = None,
    only: tuple[str, ...] = ("",),
) -> Weights:
    """Every tensor the config calls for, as stored (dtype unchanged: an FP8 checkpoint's
    weights stay e4m3 beside their block scales, `<name>_scale_inv`, checked here; the model
    dequantizes them or keeps them, as its kernels can use them), shape-checked. `rows`: the
    tensors of which only these rows are read (a tensor-parallel rank's slices: the rest of
    the tensor never reaches memory). `experts`: the routed experts read (`Weights.experts`;
    an expert stored per expert, `...experts.<e>.`: gpt-oss's stacked experts are read
    whole). `only`: the tensors whose names start so (an image encoder's alone)."""
    from safetensors import safe_open

    family = families.of(config)
    wanted = {n for n in families.expected_shapes(config) if n.startswith(only)}
    if config.fp8_block is not None and family.own_scales is not None:
        wanted |= {family.own_scales(name) for name in wanted}
    elif config.fp8_block is not None:
        wanted |= {name + SCALE for name in wanted if name.endswith(".weight")}
    out = Weights({}, experts)
    canonical = families.stored_name(config)

    def read_now(name: str) -> bool:
        expert = EXPERT.search(name)
        return experts is None or expert is None or int(expert[1]) in experts

    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                # e.g. rotary inv_freq buffers, a tied lm_head copy or MTP layers are skipped
                names = {canonical(name): name for name in f.keys()}  # noqa: SIM118
                shapes = {n: f.get_slice(names[n]).get_shape() for n in names if n in wanted}
                check_shapes(file, config, shapes)
                tensors = {
                    n: f.get_slice(names[n])[rows[n]] if rows and n in rows else
                    f.get_tensor(names[n])
                    for n in shapes if read_now(n)
                }  # fmt: skip
                out.files |= {n: (file, names[n]) for n in shapes}
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises several types for a bad header
            raise ModelLoadError(file, f"not a valid safetensors file: {e}") from e
        out |= tensors
    check_complete(path, config, out.files, only)
    if config.fp8_block is not None and family.own_scales is None:  # else the family's
        check_fp8_scales(path, out, config.fp8_block)
    return out


SCALE = "_scale_inv"  # a weight's FP8 block scales: `<name>.weight_scale_inv`
EXPERT = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's tensor, stored per expert


def check_fp8_scales(path: Path, tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> None:
    """Each FP8 (e4m3) weight has its block scales [ceil(out / b0), ceil(in / b1)]."""
    for name, t in tensors.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        scale = tensors.get(name + SCALE)
        rows, cols = t.shape
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if scale is None or tuple(scale.shape) != want:
            got = None if scale is None else tuple(scale.shape)
            raise ModelLoadError(path, f"{name}{SCALE}: shape {got}, FP8 blocks need {want}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An FP8 (e4m3) weight times its block scales, in float32."""
    rows, cols = weight.shape
    expanded = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * expanded[:rows, :cols]


def check_mtp(path: Path, config: ModelConfig) -> None:
    """ModelLoadError unless the checkpoint has an MTP layer its family serves: declared
    (num_nextn_predict_layers) and stored (transformers declares one and saves none). Reads
    the files' headers only."""
    from safetensors import safe_open

    family = families.of(config)
    module = family.mtp_module()
    if module is None or mtp_layers(path) < 1:
        raise ModelLoadError(
            path,
            "--speculative mtp needs a DeepSeek-V3 or V4 checkpoint "
            "with num_nextn_predict_layers >= 1",
        )
    marker, canonical = module.mtp_marker(config), families.stored_name(config)
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            if any(canonical(stored) == marker for stored in f.keys()):  # noqa: SIM118
                return
    raise ModelLoadError(path, f"no MTP layer: {marker} is missing")
