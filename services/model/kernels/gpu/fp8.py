"""DeepSeek's FP8 weights kept in FP8 on the GPU: products by e4m3 weights with block scales,
dequantized tile by tile inside the kernel (weight-only FP8: activations stay in the compute
dtype).

A checkpoint's FP8 matrix W [out, in] comes with float32 scales S [ceil(out / b0),
ceil(in / b1)], one per b0 x b1 block (`weight_scale_inv`, `weight_block_size`; DeepSeek's are
128 x 128). Its value is W * S broadcast over the blocks. On CPUs the loader dequantizes it
(hf_dir.dequantize); here the weight stays one byte an element in device memory, half of
bfloat16's, which is what decode reads each step, and the scales are applied per tile:

    y[t, n] = sum over k-tiles j of  S[n // b0, j] * (x[t, k-tile j] . W[n, k-tile j])

with k-tiles that never straddle a scale block (BLOCK_K divides b1). The scales are kept one
row per output row ([out, ceil(in / b1)], 1/32 of the weight's bytes in float32), so matrices
fused into one product (q_a with kv_a, gate with up) stack whatever their row counts.

A program computes a BLOCK_M x BLOCK_N tile of y, its sums over k in one fixed order with tile
sizes that do not depend on the row count: a row's result is the same in any batch. The
product of a tile is in the compute dtype with float32 sums (float32 products in IEEE
precision, not TF32); under Triton's interpreter, whose bfloat16 tl.dot is wrong (gpu/
attention.py), the exact float32 product of the same bfloat16 numbers instead.
"""

from __future__ import annotations

import torch

from services.model.kernels.gpu.row_gemm import tiled_matmul

MAX_BLOCK_K = 128  # k per step, at most; a divisor of the scale block


def row_scales(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """Block scales [ceil(rows / b0), kb] -> one row of them per output row [rows, kb]."""
    return scale.float().repeat_interleave(block_rows, 0)[:rows].contiguous()


def supported(block: tuple[int, int]) -> bool:
    """Whether the kernel takes this scale block: its width a power of two, at least 16
    (the k-tile divides it, and tl.dot wants 16)."""
    width = block[1]
    return width >= 16 and width & (width - 1) == 0


class Fp8BlockLinear:
    """`Linear` over an FP8 weight [out, in] and its scales, one per output row and b1 inputs."""

    def __init__(
        self,
        weight: torch.Tensor,  # [out, in] float8_e4m3fn, on the device
        scales: torch.Tensor,  # [out, ceil(in / b1)] float32
        scale_cols: int,  # b1
        bias: torch.Tensor | None = None,
    ) -> None:
        assert weight.dtype == torch.float8_e4m3fn and supported((1, scale_cols))
        assert scales.shape == (weight.shape[0], -(-weight.shape[1] // scale_cols))
        self.weight = weight.contiguous()
        self.scales = scales.float().contiguous()
        self.scale_cols = scale_cols
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_matmul(x, self.weight, self.scales, self.scale_cols, self.bias)

    def dequantized(self) -> torch.Tensor:
        """The weight's value [out, in] in float32 (the reference the kernel is tested on)."""
        expanded = self.scales.repeat_interleave(self.scale_cols, 1)[:, : self.weight.shape[1]]
        return self.weight.float() * expanded


def fp8_matmul(
    x: torch.Tensor,  # [T, in], the compute dtype
    weight: torch.Tensor,  # [out, in] e4m3
    scales: torch.Tensor,  # [out, ceil(in / scale_cols)] float32
    scale_cols: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, out], x's dtype
    """The tiled product (gpu/row_gemm.py) with the scales applied per k-tile."""
    return tiled_matmul(x, weight, scales, min(scale_cols, MAX_BLOCK_K), bias, scale_cols)
