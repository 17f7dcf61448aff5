"""DeepSeek-V4's quantized checkpoints, dequantized at load (CPUs compute in float32 or
bfloat16): dense products in FP8 (e4m3) with a scale per block of weight_block_size (128 x 128),
routed experts in FP8 the same way or in FP4 (`expert_dtype: fp4`): int8 bytes holding two
e2m1 values (the low nibble the even column), one scale per row and 32 columns. Scales are
float32 or ue8m0 (a power of two a byte), stored as `<name>.scale` (DeepSeek's spelling) or
`<name>.weight_scale_inv` (transformers'). Tensors kept in higher precision (the compressors',
the router's, norms, biases) are read as they are."""

from __future__ import annotations

import torch

from services.model.errors import ModelLoadError
from services.model.loading import hf_dir

# e2m1 codes 0..15: sign, two exponent bits, one mantissa bit
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
FP4_GROUP = 32  # columns per scale


def scale_name(weight: str) -> str:
    return weight.removesuffix(".weight") + ".scale"


def dequantize(
    weights: dict[str, torch.Tensor], name: str, block: tuple[int, int] | None
) -> torch.Tensor:
    """The tensor `name` in float32 if it is stored quantized, else as stored."""
    t = weights[name]
    if t.dtype not in (torch.float8_e4m3fn, torch.int8):
        return t
    scale = weights.get(scale_name(name))
    if scale is None:
        raise ModelLoadError(name, f"a {t.dtype} weight without its scale {scale_name(name)!r}")
    scale = scale.float()
    if t.dtype == torch.int8:
        return _fp4(name, t, scale)
    assert block is not None
    rows, cols = t.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise ModelLoadError(name, f"scale of shape {tuple(scale.shape)}, FP8 blocks need {want}")
    return hf_dir.dequantize(t, scale, block)


def _fp4(name: str, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, half = packed.shape
    want = (rows, 2 * half // FP4_GROUP)
    if tuple(scale.shape) != want:
        raise ModelLoadError(name, f"scale of shape {tuple(scale.shape)}, FP4 groups need {want}")
    codes = packed.view(torch.uint8)
    values = torch.stack((E2M1[(codes & 0xF).long()], E2M1[(codes >> 4).long()]), dim=-1)
    return values.view(rows, 2 * half) * scale.repeat_interleave(FP4_GROUP, dim=1)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as FP4 bytes and ue8m0 scales (the smallest power of two that fits each group
    of 32 under e2m1's 6): what a V4 checkpoint stores. For tests and tools."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // FP4_GROUP, FP4_GROUP)
    top = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(top / 6.0)))
    scaled = (groups / scale[..., None]).view(rows, cols)
    codes = (scaled[..., None] - E2M1).abs().argmin(dim=-1).to(torch.uint8)  # nearest value
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as e4m3 with a ue8m0 scale per block (its largest value under e4m3's 448)."""
    rows, cols = weight.shape
    br, bc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(br * block[0], bc * block[1])
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(br, block[0], bc, block[1])
    top = tiles.abs().amax(dim=(1, 3)).clamp(min=2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(top / 448.0)))
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    q = (padded / expanded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)
