"""Products by a weight whose rows do not depend on the batch (`--deterministic` on a GPU).

cuBLAS picks its kernel, its tiles and whether to split the sum over k by the shape of the
product, so on a GPU a row of x @ W^T takes other bits at another row count: a request's
logits would change with the requests batched beside it, which the CPUs' products never do
(services/model/layers/linear.py). Here each program computes a BLOCK_M x BLOCK_N tile of the
product, summing k in BLOCK_K steps in one fixed order, with tile sizes that never depend on
the number of rows: every output element is the same sequence of operations whatever the
batch, so a row's bits are too (tests/services/model/test_triton_row_gemm.py, under Triton's
interpreter: a row alike at 1, 7, 64 and 300 rows and at any place among them).

Sums in float32, the result rounded once to the compute dtype; float32 products in IEEE
precision, not TF32. Under the interpreter, whose bfloat16 tl.dot is wrong (gpu/attention.py),
the exact float32 product of the same bfloat16 numbers instead. What it costs against cuBLAS
is measured by the GPU check (bench/gpu_check, deterministic on and off). The same kernel,
with a scale per output row and k-tile, multiplies by DeepSeek's FP8 weights (gpu/fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.model.kernels import gpu
from services.model.kernels.gpu.rounding import round_to

BLOCK_M = 16  # rows of x per program (tl.dot's smallest)
BLOCK_N = 64  # output features per program
BLOCK_K = 64  # k per step


class RowInvariantLinear:
    """`Linear` over a weight [out, in] whose products are row-invariant (above)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,  # default: x's (float32: the logits')
    ) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.out_features = int(weight.shape[0])
        self.out_dtype = out_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return row_matmul(x, self.weight, self.bias, self.out_dtype)


def row_matmul(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in], x's dtype
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, out]
    return tiled_matmul(x, weight, None, BLOCK_K, bias, out_dtype=out_dtype)


def tiled_matmul(
    x: torch.Tensor,  # [T, in], the compute dtype
    weight: torch.Tensor,  # [out, in], x's dtype or e4m3
    scales: torch.Tensor | None,  # [out, ceil(in / scale_cols)] float32 (gpu/fp8.py), or None
    block_k: int,  # k per step; with scales, a divisor of scale_cols
    bias: torch.Tensor | None = None,
    scale_cols: int = 0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, out], out_dtype (default x's): the float32 sums rounded once
    """x @ (weight * scales)^T in BLOCK_M x BLOCK_N tiles, k in `block_k` steps in order."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul[grid](
        x, weight, scales if scales is not None else out, bias if bias is not None else out, out,
        rows, n, k, x.stride(0), weight.stride(0), scales.stride(0) if scales is not None else 0,
        out.stride(0), SCALE_K=max(scale_cols, 1), HAS_SCALE=scales is not None,
        HAS_BIAS=bias is not None, F32_DOT=x.dtype == torch.float32 or gpu.interpreted(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
    )  # fmt: skip
    return out


@triton.jit
def _matmul(
    x,
    w,
    s,
    bias,
    out,
    T,
    N,
    K,
    x_row,
    w_row,
    s_row,
    out_row,
    SCALE_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program: a BLOCK_M x BLOCK_N tile of x @ (w * s)^T, k in BLOCK_K steps in order."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        xs = tl.load(
            x + rm[:, None] * x_row + kk[None, :],
            mask=(rm[:, None] < T) & (kk[None, :] < K),
            other=0.0,
        )
        ws = tl.load(
            w + rn[None, :] * w_row + kk[:, None],
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        ws = ws.to(x.dtype.element_ty)  # [BLOCK_K, BLOCK_N]: e4m3 is exact in bf16 and f32
        if F32_DOT:
            part = tl.dot(xs.to(tl.float32), ws.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(xs, ws)
        if HAS_SCALE:
            part *= tl.load(s + rn * s_row + k0 // SCALE_K, mask=rn < N, other=0.0)[None, :]
        acc += part
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out + rm[:, None] * out_row + rn[None, :],
        round_to(acc, out.dtype.element_ty),
        mask=(rm[:, None] < T) & (rn[None, :] < N),
    )
