"""Latent attention in Triton: the absorbed form (families/deepseek/mla.py) over the cache of
latents read in place, one program per (row, head), decode rows and prefill chunks alike.

A program walks its sequence's blocks up to the row's position through the block table: the
query (q_lat | q_pe, float32) scores the block's latent rows (c | k_pe), an online softmax
folds them in, and the weighted latents c are summed; the output is the attended latent,
[T, heads, kv_lora_rank], which the value up-projection turns into each head's value. The
cache is read through the plain view's strides (a bfloat16 cache holds pairs), so nothing is
gathered. Scores, softmax and sums are float32. The torch path is the reference
(tests/services/model/test_triton_mla.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.model import kv_cache
from services.model.batch import ForwardBatch
from services.model.families.deepseek.mla import MlaAttention, MlaWeights, RowPlan, row_plan


class TritonMlaAttention(MlaAttention):
    """Absorbed attention for every row on the device; the per-head products of absorption
    in torch (batched matmuls)."""

    def plan(self, batch: ForwardBatch) -> object:
        return row_plan(batch)

    def forward(
        self,
        layer: MlaWeights,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: object,
    ) -> torch.Tensor:
        assert isinstance(plan, RowPlan)
        q_nope, q_pe, latent = self.project(layer, x, cos_sin)
        none = latent.new_empty(latent.shape[0], 1, 0)
        kv_cache.write(k_cache, v_cache, plan.slots, latent[:, None, :], none)
        q_lat = torch.einsum("thn,hnc->thc", q_nope.float(), layer.k_up.float())
        query = torch.cat((q_lat, q_pe.float()), dim=-1).contiguous()  # [T, heads, latent]
        attended = attend(query, k_cache, v_cache, plan, self.mla.kv_lora_rank, self.scale)
        out = torch.einsum("thc,hcv->thv", attended.to(x.dtype), layer.v_up)
        return layer.o(out.flatten(1))


def attend(
    query: torch.Tensor,  # [T, heads, D] float32, D = latent + rotary
    k_cache: torch.Tensor,  # [blocks, 1, D, bs] in the cache's layout
    v_cache: torch.Tensor,  # [blocks, 1, bs, 0]
    plan: RowPlan,
    latent: int,  # C: the first C dimensions are the latent summed into the output
    scale: float,
) -> torch.Tensor:  # [T, heads, C] float32
    rows, heads, dim = query.shape
    out = torch.empty(rows, heads, latent, dtype=torch.float32, device=query.device)
    if rows == 0:
        return out
    k, _ = kv_cache.plain_views(k_cache, v_cache)  # [blocks, 1, D/2, 2, bs]
    kb, _, kdp, kdl, kt = k.stride()
    _attend[(rows, heads)](
        query, k_cache, plan.tables, plan.tables.stride(0), plan.row_seq, plan.lens, out,
        kb, kdp, kdl, kt, heads, dim, latent, scale,
        BS=k_cache.shape[-1], BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out


@triton.jit
def _attend(
    q,
    k_cache,
    tables,
    table_row,
    row_seq,
    lens,
    out,
    kb,
    kdp,
    kdl,
    kt,
    H,
    D,
    C,
    scale,
    BS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BS)
    query = tl.load(q + (row * H + head) * D + d, mask=d < D, other=0.0) * scale
    seq = tl.load(row_seq + row)
    n = tl.load(lens + row)
    top = -float("inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BS)):
        block = tl.load(tables + seq * table_row + b)
        at = block * kb + (d[:, None] // 2) * kdp + (d[:, None] % 2) * kdl + t[None, :] * kt
        seen = (b * BS + t) < n
        keys = tl.load(k_cache + at, mask=(d[:, None] < D) & seen[None, :], other=0.0)
        keys = keys.to(tl.float32)  # [BLOCK_D, BS]: a block's latent rows, one per column
        s = tl.sum(query[:, None] * keys, axis=0)  # [BS]
        s = tl.where(seen, s, -float("inf"))
        new_top = tl.maximum(top, tl.max(s, axis=0))
        rescale = tl.exp(top - new_top)
        p = tl.exp(s - new_top)
        p = tl.where(seen, p, 0.0)
        total = total * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(keys * p[None, :], axis=1)
        top = new_top
    c = tl.arange(0, BLOCK_D)
    tl.store(out + (row * H + head) * C + c, acc / total, mask=c < C)
