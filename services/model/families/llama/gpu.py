"""The decoder's GPU path, built only where asked (each import brings Triton): FP8 weights
kept for the Triton kernel, Triton attention and element-wise ops."""

from __future__ import annotations

import torch

from services.model.config import ModelConfig
from services.model.layers.attention import Attention
from services.model.layers.layer_ops import LayerOps
from services.model.layers.linear import Linear
from services.model.layers.rope import Rotary
from services.model.loading import hf_dir


def fp8_linear(
    weights: dict[str, torch.Tensor],
    names: tuple[str, ...],
    block: tuple[int, int],
    device: torch.device,
) -> Linear | None:
    """The matrices `names`, stacked, kept in FP8 for the Triton kernel (gpu/fp8.py); None
    where one of them is not FP8 or the kernel does not take the scale block."""
    from services.model.kernels.gpu import fp8  # imports triton: only on the Triton path

    stored = [weights[n + ".weight"] for n in names]
    if not fp8.supported(block) or any(t.dtype != torch.float8_e4m3fn for t in stored):
        return None
    scales = [
        fp8.row_scales(weights[n + ".weight" + hf_dir.SCALE], t.shape[0], block[0])
        for n, t in zip(names, stored, strict=True)
    ]
    return fp8.Fp8BlockLinear(
        torch.cat(stored).to(device), torch.cat(scales).to(device), scale_cols=block[1]
    )


def triton_attention() -> Attention:
    from services.model.kernels.gpu.attention import (
        TritonAttention,  # imports triton: only if asked
    )

    return TritonAttention()


def triton_layer_ops(config: ModelConfig, rotary: Rotary) -> LayerOps:
    from services.model.kernels.gpu.layer_ops import TritonLayerOps

    return TritonLayerOps(config, rotary)
