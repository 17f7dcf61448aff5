"""`LayerOps` in Triton: one kernel per operation, each a single pass over its rows; a
program takes several rows (or (token, head) pairs) when one is small, so that small models
and decode batches do not launch thousands of tiny programs.

The roundings are the torch reference's (`TorchLayerOps`): arithmetic in float32, results
rounded to the storage dtype wherever torch rounds them, so a bfloat16 result is torch's
unless the last bit of a float32 function (exp, rsqrt, a sum's order) tips its rounding.

Tensors are passed with their strides, so views (a slice of rows, a column of a fused
projection) need no copy. Every launch turns off Triton's fusion of a multiply and an add into
one FMA: torch rounds the product first, and so do these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.model.kernels.gpu.rounding import round_to
from services.model.layers.layer_ops import TorchLayerOps

NORM_TILE = 4096  # elements a norm program holds: rows narrower than this share a program
ROTARY_TILE = 1024  # half-head elements a rotary program holds, of one or more (token, head)s
SILU_TILE = 1024  # elements a silu_mul program writes, across rows when ff is small


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    h_row_stride,
    h_col_stride,
    delta_row_stride,
    delta_col_stride,
    out_row_stride,
    rows,
    dim,
    eps,
    HAS_DELTA: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program: ROWS rows. h += delta (rounded as torch's add_), then rms_norm(h) * weight."""
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (row < rows) & (cols < dim)
    h_at = h_ptr + row * h_row_stride + cols * h_col_stride
    dtype = h_ptr.dtype.element_ty
    x = tl.load(h_at, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(
            delta_ptr + row * delta_row_stride + cols * delta_col_stride, mask=mask, other=0.0
        )
        added = round_to(x + delta.to(tl.float32), dtype)
        tl.store(h_at, added, mask=mask)
        x = added.to(tl.float32)
    mean_square = tl.sum(x * x, axis=1)[:, None] / dim
    normed = round_to(x * tl.rsqrt(mean_square + eps), dtype)
    weight = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    out = round_to(weight * normed.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


@triton.jit
def _rotary_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    q_ptr,
    k_ptr,
    qkv_row_stride,
    qkv_col_stride,
    table_row_stride,
    q_row_stride,
    k_row_stride,
    rows,
    num_heads,
    num_kv_heads,
    head_dim,
    PAIRS: tl.constexpr,
    HALF: tl.constexpr,
):
    """Program: PAIRS (token, head) pairs, q's heads then k's (they lie end to end in qkv),
    each rotated and stored to q or k. Rotate-half: with x = [x1 | x2],
    out = [x1 cos1 - x2 sin1 | x2 cos2 + x1 sin2], each product rounded, then the sum."""
    heads = num_heads + num_kv_heads
    pair = (tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)).to(tl.int64)[:, None]  # [PAIRS, 1]
    row, head = pair // heads, pair % heads
    cols = tl.arange(0, HALF)[None, :]  # [1, HALF]
    half = head_dim // 2
    mask = (pair < rows * heads) & (cols < half)  # [PAIRS, HALF]
    dtype = q_ptr.dtype.element_ty

    x_at = qkv_ptr + row * qkv_row_stride + (head * head_dim + cols) * qkv_col_stride
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + half * qkv_col_stride, mask=mask, other=0.0).to(tl.float32)
    position = tl.load(positions_ptr + row, mask=pair < rows * heads, other=0)
    table_at = position * table_row_stride + cols
    cos1 = tl.load(cos_ptr + table_at, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table_at + half, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table_at, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table_at + half, mask=mask, other=0.0).to(tl.float32)
    a1 = round_to(x1 * cos1, dtype).to(tl.float32)
    b1 = round_to(-x2 * sin1, dtype).to(tl.float32)
    out1 = round_to(a1 + b1, dtype)
    a2 = round_to(x2 * cos2, dtype).to(tl.float32)
    b2 = round_to(x1 * sin2, dtype).to(tl.float32)
    out2 = round_to(a2 + b2, dtype)

    q_at = q_ptr + row * q_row_stride + head * head_dim + cols
    q_mask = mask & (head < num_heads)
    tl.store(q_at, out1, mask=q_mask)
    tl.store(q_at + half, out2, mask=q_mask)
    k_at = k_ptr + row * k_row_stride + (head - num_heads) * head_dim + cols
    k_mask = mask & (head >= num_heads)
    tl.store(k_at, out1, mask=k_mask)
    tl.store(k_at + half, out2, mask=k_mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    gate_up_row_stride,
    gate_up_col_stride,
    out_row_stride,
    rows,
    ff,
    BLOCK: tl.constexpr,
):
    """Program: BLOCK elements of the [rows, ff] output, in row order (a block may span rows):
    silu(gate) rounded, times up, rounded, as torch does."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row, col = at // ff, at % ff
    mask = at < rows * ff
    gate_at = gate_up_ptr + row * gate_up_row_stride + col * gate_up_col_stride
    gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_at + ff * gate_up_col_stride, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)
    tl.store(
        out_ptr + row * out_row_stride + col, round_to(silu.to(tl.float32) * up, dtype), mask=mask
    )


class TritonLayerOps(TorchLayerOps):
    """The kernels above, for float32 or bfloat16 tensors on one device (on the CPU only under
    Triton's interpreter, for tests)."""

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        rows, dim = h.shape
        out = h.new_empty(rows, dim, dtype=weight.dtype)  # h float32: rounded once, below
        block = triton.next_power_of_2(dim)
        per_program = max(NORM_TILE // block, 1)  # one compiled variant a model, any batch
        # delta's strides are h's when there is none: the kernel never reads it then
        d = h if delta is None else delta
        _add_rms_norm_kernel[(triton.cdiv(rows, per_program),)](
            h, d, weight, out,
            h.stride(0), h.stride(1), d.stride(0), d.stride(1), out.stride(0),
            rows, dim, eps,
            HAS_DELTA=delta is not None, ROWS=per_program, BLOCK=block,
            num_warps=min(max(per_program * block // 256, 1), 16), enable_fp_fusion=False,
        )  # fmt: skip
        return out

    def positions(self, positions: torch.Tensor) -> object:
        return positions.to(torch.int64).contiguous()

    def rotary(
        self, qkv: torch.Tensor, at: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        assert isinstance(at, torch.Tensor)
        rows = qkv.shape[0]
        q = qkv.new_empty(rows, c.num_heads, c.head_dim)
        k = qkv.new_empty(rows, c.num_kv_heads, c.head_dim)
        half = triton.next_power_of_2(c.head_dim // 2)
        pairs = rows * (c.num_heads + c.num_kv_heads)
        per_program = max(ROTARY_TILE // half, 1)
        cos, sin = self.tables.cos, self.tables.sin
        assert cos.stride(1) == 1 and cos.stride() == sin.stride()
        _rotary_kernel[(triton.cdiv(pairs, per_program),)](
            qkv, cos, sin, at, q, k,
            qkv.stride(0), qkv.stride(1), cos.stride(0), q.stride(0), k.stride(0),
            rows, c.num_heads, c.num_kv_heads, c.head_dim,
            PAIRS=per_program, HALF=half, enable_fp_fusion=False,
        )  # fmt: skip
        v = qkv[:, c.q_size + c.kv_size :].unflatten(1, (c.num_kv_heads, c.head_dim))
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, ff = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, ff)
        _silu_mul_kernel[(triton.cdiv(rows * ff, SILU_TILE),)](
            gate_up,
            out,
            gate_up.stride(0),
            gate_up.stride(1),
            out.stride(0),
            rows,
            ff,
            BLOCK=SILU_TILE,
            enable_fp_fusion=False,
        )
        return out
