"""The element-wise work of a decoder layer: residual add + RMS norm, rotary, SiLU * up.

One seam, two implementations: `TorchLayerOps`, plain torch and the reference (its roundings
are transformers'), and `CpuLayerOps`, a C kernel per operation (kernels/layer_ops.c) that
makes one pass over each row where torch makes five to ten, for the shapes it takes.

Contract of a `LayerOps`:
- `add_rms_norm(h, delta, weight, eps)` adds `delta` into `h` in place (when given), then
  returns RMS-norm(h) * weight as a new tensor in weight's dtype. Row by row: a row's result
  never depends on the others. h is in weight's dtype (the norm rounds twice, as
  transformers') or float32 while weight is not: a residual stream kept in float32 (the
  decoder's; the norm then rounds once, `wide_rms_norm`).
- `positions(p)` runs once per forward pass; `rotary(qkv, at)` then splits a fused qkv
  projection [T, (heads + 2 kv_heads) * D] into q [T, heads, D] and k [T, kv_heads, D], both
  rotated to the positions, and v [T, kv_heads, D] (possibly a view of qkv).
- `silu_mul(gate_up)` is silu(gate) * up for gate_up [T, 2 ff] = [gate | up].
- `router_scores(logits, sigmoid)`: a MoE router's scores, float32 [T, experts]: sigmoid, or
  softmax over each row. Row by row, as the norm.
- `router_select(scores, bias, shape)`: each row's chosen experts [T, k] (best first) and
  their weights [T, k] float32, as MoeShape routes (`select_experts`). Row by row.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from services.model.config import ModelConfig, MoeShape
from services.model.layers.rope import Rotary, apply_rotary
from services.settings import DEFAULTS


class LayerOps(Protocol):
    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...

    def positions(self, positions: torch.Tensor) -> object: ...

    def rotary(
        self, qkv: torch.Tensor, at: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def router_scores(self, logits: torch.Tensor, sigmoid: bool) -> torch.Tensor: ...

    def router_select(
        self, scores: torch.Tensor, bias: torch.Tensor | None, shape: MoeShape
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # statistics in float32 whatever the compute dtype, as transformers does
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def wide_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of a float32 residual h into weight's dtype, rounded once."""
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(weight.dtype)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS norm with the weight (float32) applied in float32 too, then x's dtype (DeepSeek-V4's
    and gpt-oss's, as transformers computes them)."""
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class TorchLayerOps:
    def __init__(self, config: ModelConfig, rotary: Rotary) -> None:
        self.config = config
        self.tables = rotary

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if delta is not None:
            h.add_(delta)
        if h.dtype != weight.dtype:
            return wide_rms_norm(h, weight, eps)
        return rms_norm(h, weight, eps)

    def positions(self, positions: torch.Tensor) -> object:
        return self.tables.tables(positions)  # cos, sin: [T, 1, D]

    def rotary(
        self, qkv: torch.Tensor, at: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        assert isinstance(at, tuple)
        cos, sin = at
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def router_scores(self, logits: torch.Tensor, sigmoid: bool) -> torch.Tensor:
        return logits.sigmoid() if sigmoid else logits.softmax(dim=-1)

    def router_select(
        self, scores: torch.Tensor, bias: torch.Tensor | None, shape: MoeShape
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(scores, bias, shape)


KERNEL_LANES = 16  # every row length the C kernels see is a multiple of this


class CpuLayerOps(TorchLayerOps):
    """C kernels, one pass per row; contiguous float32 or bfloat16 tensors on the CPU."""

    def __init__(self, config: ModelConfig, rotary: Rotary, library: ctypes.CDLL) -> None:
        super().__init__(config, rotary)
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._norm = _bind(library.add_rms_norm, [p] * 4 + [i64] * 2 + [f32] + [ctypes.c_int] * 2)
        self._rotary = _bind(library.rotary, [p] * 6 + [i64] * 4 + [ctypes.c_int])
        self._silu_mul = _bind(library.silu_mul, [p] * 2 + [i64] * 2 + [ctypes.c_int])
        self._router = _bind(library.router_scores, [p] * 2 + [i64] * 2 + [ctypes.c_int])
        select: list[type] = [p, p, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int, f32]
        self._select = _bind(library.router_select, [*select, p, p])
        self.bf16 = int(rotary.cos.dtype == torch.bfloat16)

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if h.shape[1] % KERNEL_LANES:  # a width the kernel does not take (a LoRA rank)
            return super().add_rms_norm(h, delta, weight, eps)
        out = torch.empty_like(h, dtype=weight.dtype)
        rows, dim = h.shape
        if delta is not None:
            delta = _contiguous(delta.to(weight.dtype))
        self._norm(
            h.data_ptr(), None if delta is None else delta.data_ptr(),
            weight.data_ptr(), out.data_ptr(), rows, dim, eps,
            int(weight.dtype == torch.bfloat16), int(h.dtype != weight.dtype),
        )  # fmt: skip
        return out

    def positions(self, positions: torch.Tensor) -> object:
        return positions.contiguous()

    def rotary(
        self, qkv: torch.Tensor, at: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        assert isinstance(at, torch.Tensor)
        if c.head_dim % (2 * KERNEL_LANES):  # a head the kernel does not take
            return super().rotary(qkv, self.tables.tables(at))
        qkv = _contiguous(qkv)
        rows = qkv.shape[0]
        q = qkv.new_empty(rows, c.num_heads, c.head_dim)
        k = qkv.new_empty(rows, c.num_kv_heads, c.head_dim)
        self._rotary(
            qkv.data_ptr(), self.tables.cos.data_ptr(), self.tables.sin.data_ptr(),
            at.data_ptr(), q.data_ptr(), k.data_ptr(),
            rows, c.num_heads, c.num_kv_heads, c.head_dim, self.bf16,
        )  # fmt: skip
        v = qkv[:, c.q_size + c.kv_size :].view(rows, c.num_kv_heads, c.head_dim)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.shape[1] % (2 * KERNEL_LANES):  # an expert's width the kernel does not take
            return super().silu_mul(gate_up)
        gate_up = _contiguous(gate_up)
        rows, ff = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, ff)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, ff, self.bf16)
        return out

    def router_scores(self, logits: torch.Tensor, sigmoid: bool) -> torch.Tensor:
        logits = _contiguous(logits.float())
        out = torch.empty_like(logits)
        self._router(logits.data_ptr(), out.data_ptr(), *logits.shape, int(sigmoid))
        return out

    def router_select(
        self, scores: torch.Tensor, bias: torch.Tensor | None, shape: MoeShape
    ) -> tuple[torch.Tensor, torch.Tensor]:
        method = SELECT_METHODS.get(shape.topk_method)
        experts = scores.shape[1]
        if (
            method is None
            or experts > 1024
            or shape.n_group > 64
            or experts % shape.n_group
            or not 0 < shape.top_k <= experts  # (torch's topk says what is wrong)
            or not 0 < shape.topk_group <= shape.n_group
            or scores.dtype != torch.float32
        ):
            return super().router_select(scores, bias, shape)
        scores = _contiguous(scores)
        rows, k = scores.shape[0], shape.top_k
        ids = torch.empty(rows, k, dtype=torch.int64)
        weights = torch.empty(rows, k, dtype=torch.float32)
        if bias is not None:
            bias = _contiguous(bias.float())
        self._select(
            scores.data_ptr(), None if bias is None else bias.data_ptr(), rows, experts,
            shape.n_group, shape.topk_group, k, method, int(shape.norm_topk_prob),
            shape.routed_scaling_factor, ids.data_ptr(), weights.data_ptr(),
        )  # fmt: skip
        return weights, ids


SELECT_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}  # router_select's


def select_experts(
    scores: torch.Tensor, bias: torch.Tensor | None, shape: MoeShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's weights [T, k] (float32) and chosen experts [T, k], best first: the top_k
    of scores (+ bias, which steers the choice but not the weights), within the topk_group
    best groups where the method limits them; weights renormalized to sum to 1 where the
    shape says, times routed_scaling_factor."""
    s = shape
    choice = scores if bias is None else scores + bias
    if s.topk_method in ("group_limited_greedy", "noaux_tc") and s.n_group > 1:
        choice = best_groups(choice, s)
    ids = choice.topk(s.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if s.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * s.routed_scaling_factor, ids


def best_groups(choice: torch.Tensor, s: MoeShape) -> torch.Tensor:
    """`choice` with the experts outside each token's topk_group best groups masked out.
    A group ranks by its best expert (V2) or the sum of its best two (V3's noaux_tc)."""
    grouped = choice.view(choice.shape[0], s.n_group, -1)  # [T, groups, per group]
    if s.topk_method == "noaux_tc":
        rank = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        rank = grouped.amax(dim=-1)
    best = rank.topk(s.topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
    fill = 0.0 if s.topk_method == "group_limited_greedy" else float("-inf")
    return grouped.masked_fill(~keep[..., None], fill).flatten(1)


def _bind(fn: Any, argtypes: list[type]) -> Any:
    """A library function, typed for ctypes; it returns nothing."""
    fn.restype = None
    fn.argtypes = argtypes
    return fn


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def default_layer_ops(
    config: ModelConfig,
    rotary: Rotary,
    device: torch.device,
    dtype: torch.dtype,
    kernels: str = DEFAULTS.model.kernels,
) -> LayerOps:
    """`kernels` (attention.resolve_kernels): torch's (the reference), or the C kernels on
    CPUs where they build, for the rows they take, in float32, and in bfloat16 where the CPU
    has AVX-512 (without it, packing floats back into bfloat16 takes GCC several
    instructions a vector: the kernels ran at 0.6x torch's speed); the torch reference
    otherwise."""
    from services.model.layers.attention import resolve_kernels

    chosen = resolve_kernels(kernels, device)  # "triton": DecoderModel takes services/model/gpu's
    supported = dtype in (torch.float32, torch.bfloat16)  # shapes: each op checks its own
    if chosen == "c" and supported:
        from services.model import kernels as libraries

        library = libraries.load("layer_ops")
        wide = library is not None and library.layer_ops_lanes() >= KERNEL_LANES
        if library is not None and (dtype == torch.float32 or wide):
            return CpuLayerOps(config, rotary, library)
    return TorchLayerOps(config, rotary)
