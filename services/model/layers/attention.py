"""Attention over the paged KV cache: the one seam a faster kernel (Triton, C++) plugs into.

Contract of an `Attention`:
- `plan(batch)` runs once per forward pass and may precompute anything that depends only on
  the batch's layout (gather indices, masks); the plan is valid for that batch only.
- `forward(q, k, v, k_cache, v_cache, plan)` runs once per layer. It first writes the new
  rows' K and V into their slots, then returns, for every row, attention of its query over
  the first `context_len` tokens of its sequence (causal). It changes nothing else in the cache.

`TorchAttention` is the reference: plain torch, two paths. Decode rows (one new token per
sequence) are batched together: their blocks are gathered into a padded [B, L] window and
masked. Prefill chunks run one sequence at a time through scaled_dot_product_attention.

Determinism. `CpuAttention` (the C kernels) gives a row the same bits whatever else is
computed: alone or in any batch, in a prefill chunk of any length or as a decode token (both
kernels run one set of per-block functions), so a prefix-cache hit that leaves one token to
compute, a store import, a preemption or a migrated stream recomputing its output reproduce
a cold run exactly, in float32 and bfloat16 alike (tests/services/model/test_attention.py).
`TorchAttention` does not: the padded decode window and SDPA's blocking depend on the batch,
and its results move in the last bits with it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from services.model import kernels as libraries
from services.model import kv_cache
from services.model.batch import ForwardBatch, SeqSpan
from services.settings import DEFAULTS


class Attention(Protocol):
    def plan(self, batch: ForwardBatch) -> object: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, D]
        k: torch.Tensor,  # [T, kv_heads, D]
        v: torch.Tensor,  # [T, kv_heads, D]
        k_cache: torch.Tensor,  # [blocks, kv_heads, D, block_size] (layout: kv_cache.py)
        v_cache: torch.Tensor,  # [blocks, kv_heads, block_size, D]
        plan: object,
    ) -> torch.Tensor:  # [T, heads, D]
        ...


@dataclass(frozen=True)
class DecodePlan:
    rows: torch.Tensor  # [B] rows of the batch that are single decode tokens
    tables: torch.Tensor  # [B, max_blocks] block tables, padded with block 0
    lens: torch.Tensor  # [B] context lengths
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] true where a key is in context


@dataclass(frozen=True)
class PrefillPlan:
    span: SeqSpan
    # [query_len, context_len] true where attended; None when the chunk is the whole context
    # (plain causal attention over this pass's own K/V, nothing read from the cache)
    mask: torch.Tensor | None


@dataclass(frozen=True)
class TorchPlan:
    slots: torch.Tensor  # [T]
    decode: DecodePlan | None
    prefills: tuple[PrefillPlan, ...]


class TorchAttention:
    def plan(self, batch: ForwardBatch) -> TorchPlan:
        device = batch.token_ids.device
        decodes = [s for s in batch.seqs if s.is_decode]
        prefills = tuple(_prefill_plan(s, device) for s in batch.seqs if not s.is_decode)
        decode = _decode_plan(decodes, batch.block_size, device) if decodes else None
        return TorchPlan(batch.slot_mapping, decode, prefills)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: object,
    ) -> torch.Tensor:
        assert isinstance(plan, TorchPlan)
        kv_cache.write(k_cache, v_cache, plan.slots, k, v)
        out = torch.empty_like(q)
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode(q, k_cache, v_cache, plan.decode)
        for p in plan.prefills:
            rows = slice(p.span.row, p.span.row + p.span.query_len)
            out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, p)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan
    ) -> torch.Tensor:
        return _decode(q, k_cache, v_cache, plan)


@dataclass(frozen=True)
class PrefillSpans:
    """The prefill chunks of a batch, as the C kernel takes them."""

    rows: torch.Tensor  # [S] first row of each chunk
    qlens: torch.Tensor  # [S] its queries
    lens: torch.Tensor  # [S] context length: its last query's position + 1
    tables: torch.Tensor  # [S, max_blocks] block tables, padded with block 0


@dataclass(frozen=True)
class CpuPlan:
    slots: torch.Tensor  # [T]
    decode: DecodePlan | None
    prefill: PrefillSpans | None


class CpuAttention:
    """C kernels that read KV blocks in place (kernels/paged_attention.c): no gather, no
    masks, and a row's result independent of the batch, of its chunk, and of which kernel ran
    it. Decode rows and prefill chunks each take one call per layer."""

    def __init__(self, library: ctypes.CDLL) -> None:
        # bfloat16 products on AMX tiles where they run (both kernels alike: same bits)
        usable = libraries.amx_usable(library._name, "paged_attention_amx")
        self.amx = bool(library.paged_attention_use_amx(int(usable)))
        self.kernel = _bind(library.paged_decode_attention, arrays=4)
        self.prefill_kernel = _bind(library.paged_prefill_attention, arrays=5)
        self.write_kernel = library.write_kv
        self.write_kernel.restype = None
        self.write_kernel.argtypes = (
            [ctypes.c_void_p] * 2
            + [ctypes.c_int64]
            + [ctypes.c_void_p] * 3
            + [ctypes.c_int64] * 3
            + [ctypes.c_int]
        )

    def plan(self, batch: ForwardBatch) -> CpuPlan:
        device = batch.token_ids.device
        decodes = [s for s in batch.seqs if s.is_decode]
        prefills = [s for s in batch.seqs if not s.is_decode]
        return CpuPlan(
            batch.slot_mapping,
            _decode_plan(decodes, batch.block_size, device) if decodes else None,
            _prefill_spans(prefills, device) if prefills else None,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: object,
    ) -> torch.Tensor:
        assert isinstance(plan, CpuPlan)
        self._write(k, v, k_cache, v_cache, plan.slots)
        q = q.to(k_cache.dtype).contiguous()  # the kernels take q in the cache's dtype
        out = torch.empty_like(q)
        if plan.decode is not None:
            self._decode_into(q, k_cache, v_cache, plan.decode, out)
        if plan.prefill is not None:
            self._prefill_into(q, k_cache, v_cache, plan.prefill, out)
        return out

    def _write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        k, v = k.to(k_cache.dtype).contiguous(), v.to(v_cache.dtype)
        if v.stride()[1:] != (v.shape[2], 1):  # the kernel takes rows of v at any stride
            v = v.contiguous()
        self.write_kernel(
            k.data_ptr(), v.data_ptr(), v.stride(0), slots.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), k.shape[0], k.shape[1], k.shape[2],
            int(k_cache.dtype == torch.bfloat16),
        )  # fmt: skip

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan
    ) -> torch.Tensor:
        queries = q.to(k_cache.dtype).contiguous()
        out = torch.empty_like(queries)
        self._decode_into(queries, k_cache, v_cache, plan, out)
        return out[plan.rows]

    def _decode_into(
        self,
        q: torch.Tensor,  # [T, heads, D] contiguous, in the cache's dtype
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
        out: torch.Tensor,  # [T, heads, D] like q: the decode rows are written
    ) -> None:
        _, heads, dim = q.shape
        _check(self.kernel(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16),
            plan.tables.data_ptr(), plan.lens.data_ptr(), plan.rows.data_ptr(), out.data_ptr(),
            plan.rows.shape[0], heads, k_cache.shape[1], dim, v_cache.shape[2],
            plan.tables.shape[1], dim**-0.5,
        ))  # fmt: skip

    def _prefill_into(
        self,
        q: torch.Tensor,  # [T, heads, D] contiguous, in the cache's dtype
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spans: PrefillSpans,
        out: torch.Tensor,  # [T, heads, D] like q: the chunks' rows are written
    ) -> None:
        _, heads, dim = q.shape
        _check(self.prefill_kernel(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16), spans.tables.data_ptr(),
            spans.rows.data_ptr(), spans.qlens.data_ptr(), spans.lens.data_ptr(), out.data_ptr(),
            spans.rows.shape[0], heads, k_cache.shape[1], dim, v_cache.shape[2],
            spans.tables.shape[1], dim**-0.5,
        ))  # fmt: skip


def _bind(fn: Any, arrays: int) -> Any:
    """A kernel's signature: q, k, v, the bf16 flag, `arrays` more pointers, six sizes (count,
    heads, kv_heads, head dim, block size, table width) and the scale; it returns 0 or -1."""
    fn.restype = ctypes.c_int
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = (
        [pointer] * 3 + [ctypes.c_int] + [pointer] * arrays + [size] * 6 + [ctypes.c_float]
    )
    return fn


def _check(status: int) -> None:
    if status != 0:
        raise RuntimeError("paged attention kernel failed (sizes out of range or no memory)")


def _prefill_spans(spans: list[SeqSpan], device: torch.device) -> PrefillSpans:
    width = max(len(s.block_table) for s in spans)
    tables = torch.zeros(len(spans), width, dtype=torch.int64, device=device)
    for i, s in enumerate(spans):
        tables[i, : len(s.block_table)] = s.block_table

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PrefillSpans(
        t([s.row for s in spans]),
        t([s.query_len for s in spans]),
        t([s.context_len for s in spans]),
        tables,
    )


KERNEL_BLOCK_SIZE = 16  # the block size the C kernel is specialised for
KERNEL_MAX_DIM = 256  # head dims it takes: multiples of its vector width, up to 256
KERNEL_MAX_GROUP = 16  # query heads sharing one KV head


KERNELS = ("auto", "c", "torch", "triton")


def resolve_kernels(name: str, device: torch.device) -> str:
    """Which kernels `--kernels NAME` means on `device`: auto is Triton on CUDA devices, the
    C kernels on CPUs (each falling back to torch for shapes it does not take), torch
    elsewhere (e.g. the `meta` device)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernels {name!r} (choose {', '.join(KERNELS)})")
    if name == "auto":
        return {"cuda": "triton", "cpu": "c"}.get(device.type, "torch")
    if name == "c" and device.type != "cpu":
        raise ValueError(f"--kernels c runs on CPUs, not {device}")
    if name == "triton":
        from services.model.kernels import gpu

        if not gpu.available():
            raise ValueError("--kernels triton: triton is not installed here (pip install triton)")
    return name


def default_attention(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    block_size: int = KERNEL_BLOCK_SIZE,
    kernels: str = DEFAULTS.model.kernels,
) -> Attention:
    """`kernels` (resolve_kernels): the C kernels on CPUs where they build, for float32 and
    bfloat16 caches and the shapes they take (`group`: query heads per KV head), else torch's.
    (Triton's are in kernels/gpu/; DecoderModel takes them for `--kernels triton`.)"""
    chosen = resolve_kernels(kernels, device)
    supported = (
        dtype in (torch.float32, torch.bfloat16)
        and block_size == KERNEL_BLOCK_SIZE
        and head_dim <= KERNEL_MAX_DIM
        and group <= KERNEL_MAX_GROUP
    )
    if chosen == "c" and supported:
        library = libraries.load("paged_attention")
        if library is not None and head_dim % library.paged_attention_lanes() == 0:
            return CpuAttention(library)
    return TorchAttention()


def _decode_plan(spans: list[SeqSpan], block_size: int, device: torch.device) -> DecodePlan:
    width = max(len(s.block_table) for s in spans)
    tables = torch.zeros(len(spans), width, dtype=torch.int64, device=device)
    for i, s in enumerate(spans):
        tables[i, : len(s.block_table)] = s.block_table
    lens = torch.tensor([s.context_len for s in spans], device=device)
    mask = torch.arange(width * block_size, device=device)[None, :] < lens[:, None]
    rows = torch.tensor([s.row for s in spans], device=device)
    return DecodePlan(rows, tables, lens, mask[:, None, None, :])


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan
) -> torch.Tensor:
    batch, kv_heads = plan.rows.shape[0], k_cache.shape[1]
    # queries grouped by the KV head they share: [B, kv_heads, group, D]
    qd = q[plan.rows].view(batch, kv_heads, -1, q.shape[-1])
    keys, values = kv_cache.gather(k_cache, v_cache, plan.tables)  # [B, L, kv_heads, D]
    out = F.scaled_dot_product_attention(
        qd, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=plan.mask
    )
    return out.reshape(batch, -1, q.shape[-1])


def _prefill_plan(span: SeqSpan, device: torch.device) -> PrefillPlan:
    if span.context_len == span.query_len:
        return PrefillPlan(span, None)
    start = span.context_len - span.query_len
    query_pos = start + torch.arange(span.query_len, device=device)
    mask = torch.arange(span.context_len, device=device)[None, :] <= query_pos[:, None]
    return PrefillPlan(span, mask)


def _prefill(
    q: torch.Tensor,  # [n, heads, D]
    k: torch.Tensor,  # [n, kv_heads, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
) -> torch.Tensor:
    if plan.mask is None:
        keys, values = k, v
    else:
        n = plan.span.context_len
        keys, values = kv_cache.gather(k_cache, v_cache, plan.span.block_table)
        keys, values = keys[:n], values[:n]
    group = q.shape[1] // keys.shape[1]
    # Heads share KV in groups (GQA), expanded here: with enable_gqa, or without a batch
    # dimension, SDPA takes torch's math path on CPU, 3-5x slower than its flash kernel.
    keys = keys.repeat_interleave(group, dim=1) if group > 1 else keys
    values = values.repeat_interleave(group, dim=1) if group > 1 else values
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, heads, n, D]
        keys.transpose(0, 1)[None],  # [1, heads, context, D]
        values.transpose(0, 1)[None],
        attn_mask=plan.mask,
        is_causal=plan.mask is None,
    )
    return out[0].transpose(0, 1)
