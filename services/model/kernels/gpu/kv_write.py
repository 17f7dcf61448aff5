"""The paged KV write in Triton: each row's K and V into its slot of the cache, in the cache's
layout (kv_cache.py: a bfloat16 cache holds elements in pairs), through the plain views'
strides; attention.py's kernels read the same strides."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.model import kv_cache


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """Element strides of the plain views (kv_cache.plain_views): K [blocks, heads, D/2, 2, bs]
    and V [blocks, heads, bs/2, 2, D], whichever layout the dtype keeps."""
    k, v = kv_cache.plain_views(k_cache, v_cache)
    return (*k.stride(), *v.stride())


def write_kv(
    k: torch.Tensor,  # [T, kv_heads, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T]; a negative slot writes nothing (a padded row)
) -> None:
    rows, heads, dim = k.shape
    if rows == 0:
        return
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    _write_kv[(rows, heads)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots, k_cache, v_cache,
        *cache_strides(k_cache, v_cache), dim, v_cache.shape[2],
        BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip


@triton.jit
def _write_kv(
    k,
    v,
    k_row,
    k_head,
    v_row,
    v_head,
    slots,
    k_cache,
    v_cache,
    kb,
    kh,
    kdp,
    kdl,
    kt,
    vb,
    vh,
    vtp,
    vtl,
    vd,
    D,
    BS,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots + row)
    if slot >= 0:
        block = slot // BS
        t = slot % BS
        d = tl.arange(0, BLOCK_D)
        inside = d < D
        kx = tl.load(k + row * k_row + head * k_head + d, mask=inside)
        vx = tl.load(v + row * v_row + head * v_head + d, mask=inside)
        k_at = block * kb + head * kh + (d // 2) * kdp + (d % 2) * kdl + t * kt
        v_at = block * vb + head * vh + (t // 2) * vtp + (t % 2) * vtl + d * vd
        tl.store(k_cache + k_at, kx, mask=inside)
        tl.store(v_cache + v_at, vx, mask=inside)
