"""Paged attention in Triton: decode split along the context, and prefill chunks reading their
blocks in place (the KV write: kv_write.py). Same contract as `services.model.layers.attention`
(the torch path is the reference, tests/services/model/test_triton_attention.py holds them
together).

    decode:  grid (sequence, KV head, split). A split is SPLIT_BLOCKS blocks of the context;
             its program scores them for the G query heads sharing the KV head and keeps a
             running softmax; `_combine` then merges the splits by their log-sum-exp
             (flash-decoding: one long sequence fills the device, a short one exits early).
    prefill: grid (chunk, query tile, head). A tile of BLOCK_M queries walks the chunk's
             blocks up to its last position through the block table, causal mask on the
             diagonal, online softmax, two tl.dot products per block.

Both read the cache in its layout (kv_cache.py: a bfloat16 cache holds elements in pairs),
through the plain views' strides, so blocks are never gathered or copied. Scores, softmax
and sums are float32; the products take the cache's dtype (float32 products in IEEE
precision, not TF32). Under Triton's interpreter a bfloat16 tl.dot is wrong (3.9: it
multiplies the raw bits), so there the products of bfloat16 operands run in float32: exact
products of the same bfloat16 numbers, summed in float32 as the tensor cores sum them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.model.batch import ForwardBatch
from services.model.kernels import gpu
from services.model.kernels.gpu.kv_write import cache_strides, write_kv
from services.model.kernels.gpu.rounding import round_to

SPLIT_BLOCKS = 16  # KV blocks per decode split (256 tokens at block size 16)
BLOCK_M = 16  # prefill queries per tile


@dataclass(frozen=True)
class TritonPlan:
    slots: torch.Tensor  # [T]
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, tables, lens
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    max_query_len: int  # of the prefill chunks
    splits: int  # decode splits per sequence (covering the longest context)


class TritonAttention:
    def plan(self, batch: ForwardBatch) -> TritonPlan:
        splits = _splits(batch)
        if batch.max_query_len == 1:  # decode tokens only (a CUDA graph's batch): as they are
            every = (batch.seq_rows, batch.block_tables, batch.context_lens)
            return TritonPlan(batch.slot_mapping, every, None, 1, splits)
        decodes = [i for i, s in enumerate(batch.seqs) if s.is_decode]
        chunks = [i for i, s in enumerate(batch.seqs) if not s.is_decode]

        def pick(index: list[int]) -> torch.Tensor:
            return torch.tensor(index, dtype=torch.int64, device=batch.seq_rows.device)

        decode = None
        if decodes:
            d = pick(decodes)
            decode = (batch.seq_rows[d], batch.block_tables[d], batch.context_lens[d])
        c = pick(chunks)
        prefill = (batch.seq_rows[c], batch.query_lens[c], batch.context_lens[c],
                   batch.block_tables[c])  # fmt: skip
        longest = max(batch.seqs[i].query_len for i in chunks)
        return TritonPlan(batch.slot_mapping, decode, prefill, longest, splits)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: object,
    ) -> torch.Tensor:
        assert isinstance(plan, TritonPlan)
        write_kv(k, v, k_cache, v_cache, plan.slots)
        q = q.to(k_cache.dtype).contiguous()
        out = torch.empty_like(q)
        if plan.decode is not None:
            rows, tables, lens = plan.decode
            decode(q, k_cache, v_cache, rows, tables, lens, plan.splits, out)
        if plan.prefill is not None:
            rows, qlens, lens, tables = plan.prefill
            prefill(q, k_cache, v_cache, rows, qlens, lens, tables, plan.max_query_len, out)
        return out


def _splits(batch: ForwardBatch) -> int:
    blocks = -(-batch.max_context_len // batch.block_size)
    return max(1, -(-blocks // SPLIT_BLOCKS))


def decode(
    q: torch.Tensor,  # [T, heads, D] contiguous, the cache's dtype
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [B] row of each sequence's query
    tables: torch.Tensor,  # [B, width]
    lens: torch.Tensor,  # [B] context lengths (0: a padded row, output 0)
    splits: int,
    out: torch.Tensor,  # [T, heads, D]: the decode rows are written
) -> None:
    batch = rows.shape[0]
    _, heads, dim = q.shape
    kv_heads, bs = k_cache.shape[1], v_cache.shape[2]
    group = heads // kv_heads
    direct = splits == 1  # every context in one split: normalised and written to out at once
    partial = lse = out
    if not direct:
        partial = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _decode_split[(batch, kv_heads, splits)](
        q, k_cache, v_cache, rows, tables, tables.stride(0), lens, partial, lse, out,
        *cache_strides(k_cache, v_cache), dim**-0.5, heads, dim, splits,
        G=group, BLOCK_G=max(triton.next_power_of_2(group), 2), BS=bs,
        BLOCK_D=triton.next_power_of_2(dim), SPLIT=SPLIT_BLOCKS, DIRECT=direct,
    )  # fmt: skip
    if not direct:
        _combine[(batch, heads)](
            partial, lse, rows, out, heads, dim, splits,
            BLOCK_S=max(triton.next_power_of_2(splits), 2), BLOCK_D=triton.next_power_of_2(dim),
        )  # fmt: skip


@triton.jit
def _decode_split(
    q,
    k_cache,
    v_cache,
    rows,
    tables,
    table_row,
    lens,
    partial,
    lse,
    out,
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
    scale,
    H,
    D,
    S,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens + b)
    row = tl.load(rows + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BS)
    heads = kv * G + g
    g_in = g < G
    d_in = d < D
    qx = tl.load(
        q + (row * H + heads)[:, None] * D + d[None, :],
        mask=g_in[:, None] & d_in[None, :],
        other=0.0,
    ).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_dim = (d // 2) * kdp + (d % 2) * kdl  # [D]
    v_tok = (t // 2) * vtp + (t % 2) * vtl  # [BS]
    first = split * SPLIT
    last = tl.minimum(first + SPLIT, tl.cdiv(length, BS))  # this split's blocks that hold tokens
    for block_index in range(first, last):
        block = tl.load(tables + b * table_row + block_index)
        pos = block_index * BS + t
        seen = pos < length
        base_k = k_cache + block * kb + kv * kh
        inside = seen[:, None] & d_in[None, :]
        keys = tl.load(base_k + k_dim[None, :] + t[:, None] * kt, mask=inside, other=0.0)
        keys = keys.to(tl.float32)
        scores = tl.sum(qx[:, None, :] * keys[None, :, :], axis=2) * scale  # [G, BS]
        scores = tl.where(seen[None, :], scores, float("-inf"))
        top = tl.maximum(m, tl.max(scores, axis=1))
        weights = tl.exp(scores - top[:, None])
        rescale = tl.exp(m - top)
        base_v = v_cache + block * vb + kv * vh
        values = tl.load(base_v + v_tok[:, None] + d[None, :] * vd, mask=inside, other=0.0)
        values = values.to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
        total = total * rescale + tl.sum(weights, axis=1)
        m = top
    result = acc / tl.maximum(total, 1e-30)[:, None]
    inside = g_in[:, None] & d_in[None, :]
    if DIRECT:  # one split (S == 1): what _combine would write, bit for bit
        at = (row * H + heads)[:, None] * D + d[None, :]
        tl.store(out + at, round_to(result, out.dtype.element_ty), mask=inside)
    else:
        at = (b * H + heads) * S + split
        tl.store(partial + at[:, None] * D + d[None, :], result, mask=inside)
        tl.store(lse + at, m + tl.log(tl.maximum(total, 1e-30)), mask=g_in)


@triton.jit
def _combine(partial, lse, rows, out, H, D, S, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    at = (b * H + head) * S + s
    weights_log = tl.load(lse + at, mask=s < S, other=float("-inf"))
    top = tl.max(weights_log, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padded row: nothing seen
    weights = tl.exp(weights_log - top)
    parts = tl.load(
        partial + at[:, None] * D + d[None, :], mask=(s < S)[:, None] & (d < D)[None, :], other=0.0
    )
    summed = tl.sum(weights[:, None] * parts, axis=0) / tl.maximum(tl.sum(weights, axis=0), 1e-30)
    row = tl.load(rows + b)
    tl.store(out + (row * H + head) * D + d, round_to(summed, out.dtype.element_ty), mask=d < D)


def prefill(
    q: torch.Tensor,  # [T, heads, D] contiguous, the cache's dtype
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [S] first row of each chunk
    qlens: torch.Tensor,  # [S]
    lens: torch.Tensor,  # [S] context length: the last query's position + 1
    tables: torch.Tensor,  # [S, width]
    max_query_len: int,
    out: torch.Tensor,  # [T, heads, D]: the chunks' rows are written
) -> None:
    _, heads, dim = q.shape
    kv_heads, bs = k_cache.shape[1], v_cache.shape[2]
    grid = (rows.shape[0], triton.cdiv(max_query_len, BLOCK_M), heads)
    _prefill[grid](
        q, k_cache, v_cache, rows, qlens, lens, tables, tables.stride(0), out,
        *cache_strides(k_cache, v_cache), dim**-0.5, heads, dim,
        G=heads // kv_heads, BS=bs, BLOCK_M=BLOCK_M, BLOCK_D=triton.next_power_of_2(dim),
        F32_DOT=q.dtype == torch.float32 or gpu.interpreted(),
    )  # fmt: skip


@triton.jit
def _prefill(
    q,
    k_cache,
    v_cache,
    rows,
    qlens,
    lens,
    tables,
    table_row,
    out,
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
    scale,
    H,
    D,
    G: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    s = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    qlen = tl.load(qlens + s)
    if tile * BLOCK_M < qlen:
        length = tl.load(lens + s)
        row0 = tl.load(rows + s)
        kv = head // G
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # queries of the chunk
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BS)
        q_in = i < qlen
        d_in = d < D
        position = length - qlen + i  # [M]
        qx = tl.load(
            q + ((row0 + i) * H + head)[:, None] * D + d[None, :],
            mask=q_in[:, None] & d_in[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_dim = (d // 2) * kdp + (d % 2) * kdl
        v_tok = (t // 2) * vtp + (t % 2) * vtl
        last = tl.minimum(length - qlen + (tile + 1) * BLOCK_M, length)  # positions < last
        for block_index in range(0, tl.cdiv(last, BS)):
            block = tl.load(tables + s * table_row + block_index)
            pos = block_index * BS + t
            base_k = k_cache + block * kb + kv * kh
            keys_t = tl.load(
                base_k + k_dim[:, None] + t[None, :] * kt,
                mask=d_in[:, None] & (pos < length)[None, :],
                other=0.0,
            )
            if F32_DOT:
                scores = tl.dot(qx.to(tl.float32), keys_t.to(tl.float32), input_precision="ieee")
            else:
                scores = tl.dot(qx, keys_t)
            seen = (pos[None, :] <= position[:, None]) & q_in[:, None]
            scores = tl.where(seen, scores * scale, float("-inf"))
            top = tl.maximum(m, tl.max(scores, axis=1))
            safe = tl.where(top == float("-inf"), 0.0, top)  # a row that has seen nothing yet
            weights = tl.exp(scores - safe[:, None])
            rescale = tl.exp(m - safe)
            base_v = v_cache + block * vb + kv * vh
            values = tl.load(
                base_v + v_tok[:, None] + d[None, :] * vd,
                mask=(pos < length)[:, None] & d_in[None, :],
                other=0.0,
            )
            p = round_to(weights, values.dtype)  # the weights in the cache's dtype, as flash
            if F32_DOT:
                summed = tl.dot(p.to(tl.float32), values.to(tl.float32), input_precision="ieee")
            else:
                summed = tl.dot(p, values)
            acc = acc * rescale[:, None] + summed
            total = total * rescale + tl.sum(weights, axis=1)
            m = top
        result = acc / tl.maximum(total, 1e-30)[:, None]
        rounded = round_to(result, out.dtype.element_ty)
        at = ((row0 + i) * H + head)[:, None] * D + d[None, :]
        tl.store(out + at, rounded, mask=q_in[:, None] & d_in[None, :])
