"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

A token's cache row, per layer, is what every head's key and value are made from: the
normalized KV latent c (kv_lora_rank) and the rotary key k_pe (rope_dim), shared by all heads,
stored as one "head" of latent_dim = kv_lora_rank + rope_dim in kv_cache.py's K layout (no V):
576 elements for DeepSeek-V3 where per-head K and V would take 2 x 128 x 128 = 32,768.

Per head h, with W_UK[h] [nope, kv_lora] and W_UV[h] [v, kv_lora] the rows of kv_b_proj:

    key_t   = [W_UK[h] c_t | k_pe_t]           value_t = W_UV[h] c_t
    score_t = scale * (q_nope . W_UK[h] c_t + q_pe . k_pe_t)

Two forms compute the same attention:
- expanded: up-project every context latent into per-head keys and values, then ordinary
  attention. The work of the up-projection grows with the context; the right form for a
  prefill chunk, whose queries share it.
- absorbed: fold W_UK into the query (q_lat = W_UK[h]^T q_nope, [kv_lora]) and score it
  against the latents directly; the softmax-weighted sum of latents is up-projected once by
  W_UV. Nothing per context token is expanded: the form for decode, where one query meets the
  whole context.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.model import kernels as libraries
from services.model import kv_cache
from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.families.deepseek.config import MlaShape, mla_of
from services.model.layers.attention import (
    KERNEL_BLOCK_SIZE,
    DecodePlan,
    PrefillPlan,
    TorchAttention,
    TorchPlan,
)
from services.model.layers.layer_ops import LayerOps
from services.model.layers.linear import Linear
from services.model.layers.rope import apply_rotary, apply_rotary_pairs, yarn_mscale

LORA_NORM_EPS = 1e-6  # the q_a and kv_a norms' epsilon: DeepSeek's, not config.rms_norm_eps


@dataclass(frozen=True)
class MlaWeights:
    """One layer's MLA weights, arranged at load: the products that read the hidden state
    fused into one."""

    qkv_a: Linear  # hidden -> (q_lora_rank or heads * qk) + latent_dim
    q_a_norm: torch.Tensor | None  # [q_lora_rank]; None without q LoRA
    q_b: Linear | None  # q_lora_rank -> heads * qk
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: Linear  # kv_lora_rank -> heads * (nope + v): the expanded form
    k_up: torch.Tensor  # [heads, nope, kv_lora_rank]: W_UK, absorbed into the query
    v_up: torch.Tensor  # [heads, kv_lora_rank, v]: W_UV^T, applied to the attended latent
    o: Linear  # heads * v -> hidden


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(mscale_all_dim) squared where it applies."""
    mla = mla_of(config)
    scale = (mla.nope_dim + mla.rope_dim) ** -0.5
    s = config.rope_scaling
    if s is not None and s.rope_type == "yarn" and s.mscale_all_dim:
        m = yarn_mscale(s.factor, s.mscale_all_dim)
        scale = scale * m * m
    return scale


def split_kv_b(kv_b: torch.Tensor, heads: int, mla: MlaShape) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [heads * (nope + v), kv_lora] -> W_UK [heads, nope, kv_lora] and
    W_UV^T [heads, kv_lora, v]."""
    per_head = kv_b.view(heads, mla.nope_dim + mla.v_dim, mla.kv_lora_rank)
    k_up, v_up = per_head.split([mla.nope_dim, mla.v_dim], dim=1)
    return k_up.contiguous(), v_up.transpose(1, 2).contiguous()


class MlaAttention:
    """The torch reference: decode rows in the absorbed form, batched over a padded window of
    gathered latents; prefill chunks one at a time in the expanded form through SDPA."""

    def __init__(self, config: ModelConfig, ops: LayerOps) -> None:
        """`ops`: the model's layer ops; the latent's and the query's norms are theirs."""
        self.config = config
        self.ops = ops
        self.mla = mla_of(config)
        self.scale = softmax_scale(config)
        self._plans = TorchAttention()

    def plan(self, batch: ForwardBatch) -> object:
        return self._plans.plan(batch)

    def forward(
        self,
        layer: MlaWeights,
        x: torch.Tensor,  # [T, hidden], normed
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, 1, rope_dim] each
        k_cache: torch.Tensor,  # [blocks, 1, latent_dim, block_size] (kv_cache.py's layout)
        v_cache: torch.Tensor,  # [blocks, 1, block_size, 0]
        plan: object,
    ) -> torch.Tensor:  # [T, hidden]
        assert isinstance(plan, TorchPlan)
        q_nope, q_pe, latent = self.project(layer, x, cos_sin)
        none = latent.new_empty(latent.shape[0], 1, 0)
        kv_cache.write(k_cache, v_cache, plan.slots, latent[:, None, :], none)
        out = q_nope.new_empty(*q_nope.shape[:2], self.mla.v_dim)  # [T, heads, v]
        if plan.decode is not None:
            rows = plan.decode.rows
            out[rows] = self.decode(layer, q_nope[rows], q_pe[rows], k_cache, v_cache, plan.decode)
        for p in plan.prefills:
            rows_ = slice(p.span.row, p.span.row + p.span.query_len)
            out[rows_] = self.prefill(
                layer, q_nope[rows_], q_pe[rows_], latent[rows_], k_cache, v_cache, p
            )
        return layer.o(out.flatten(1))

    def project(
        self, layer: MlaWeights, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_nope [T, heads, nope], q_pe [T, heads, rope] (rotated) and the cache rows
        [T, latent_dim] = [normed c | rotated k_pe]."""
        m, heads = self.mla, self.config.num_heads
        a = layer.qkv_a(x)
        q, kv = a.split([a.shape[1] - m.latent_dim, m.latent_dim], dim=-1)
        if layer.q_b is not None:
            assert layer.q_a_norm is not None
            q = layer.q_b(self._norm(q, layer.q_a_norm))
        q = q.reshape(-1, heads, m.nope_dim + m.rope_dim)
        q_nope, q_pe = q.split([m.nope_dim, m.rope_dim], dim=-1)
        c, k_pe = kv.split([m.kv_lora_rank, m.rope_dim], dim=-1)
        rotate = apply_rotary_pairs if m.rope_pairs else apply_rotary
        cos, sin = cos_sin
        q_pe = rotate(q_pe, cos, sin)
        k_pe = rotate(k_pe[:, None, :], cos, sin)[:, 0]
        latent = torch.cat((self._norm(c, layer.kv_a_norm), k_pe), dim=-1)
        return q_nope, q_pe, latent

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.ops.add_rms_norm(x.contiguous(), None, weight, LORA_NORM_EPS)

    def decode(
        self,
        layer: MlaWeights,
        q_nope: torch.Tensor,  # [B, heads, nope]
        q_pe: torch.Tensor,  # [B, heads, rope]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
    ) -> torch.Tensor:  # [B, heads, v]
        """The absorbed form over each row's gathered latents."""
        latents, _ = kv_cache.gather(k_cache, v_cache, plan.tables)  # [B, L, 1, latent_dim]
        latents = latents[:, :, 0]
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, layer.k_up)  # [B, heads, kv_lora]
        query = torch.cat((q_lat, q_pe), dim=-1)  # [B, heads, latent_dim]
        scores = torch.einsum("bhd,bld->bhl", query.float(), latents.float()) * self.scale
        scores = scores.masked_fill(~plan.mask[:, 0], float("-inf"))  # mask: [B, 1, L]
        weights = scores.softmax(dim=-1)
        c = latents[..., : self.mla.kv_lora_rank].float()
        attended = torch.einsum("bhl,blc->bhc", weights, c).to(q_nope.dtype)
        return torch.einsum("bhc,hcv->bhv", attended, layer.v_up)

    def prefill(
        self,
        layer: MlaWeights,
        q_nope: torch.Tensor,  # [n, heads, nope]
        q_pe: torch.Tensor,  # [n, heads, rope]
        latent: torch.Tensor,  # [n, latent_dim]: this chunk's rows
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: PrefillPlan,
    ) -> torch.Tensor:  # [n, heads, v]
        """The expanded form: the context's latents up-projected to per-head keys and values."""
        m, heads = self.mla, self.config.num_heads
        if plan.mask is not None:  # a prefix in the cache: read the whole context back
            context, _ = kv_cache.gather(k_cache, v_cache, plan.span.block_table)
            latent = context[: plan.span.context_len, 0]
        c, k_pe = latent.split([m.kv_lora_rank, m.rope_dim], dim=-1)
        kv = layer.kv_b(c).view(-1, heads, m.nope_dim + m.v_dim)
        k_nope, value = kv.split([m.nope_dim, m.v_dim], dim=-1)
        key = torch.cat((k_nope, k_pe[:, None, :].expand(-1, heads, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],  # [1, heads, n, qk]
            key.transpose(0, 1)[None],  # [1, heads, context, qk]
            value.transpose(0, 1)[None],  # [1, heads, context, v]
            attn_mask=plan.mask,
            is_causal=plan.mask is None,
            scale=self.scale,
        )
        return out[0].transpose(0, 1)


@dataclass(frozen=True)
class RowPlan:
    """A batch as kernels that take each row on its own read it."""

    slots: torch.Tensor  # [T]
    tables: torch.Tensor  # [S, W] the batch's block tables
    row_seq: torch.Tensor  # [T] each row's sequence (row of tables)
    lens: torch.Tensor  # [T] tokens each row attends to: its position + 1


def row_plan(batch: ForwardBatch) -> RowPlan:
    row_seq = torch.repeat_interleave(
        torch.arange(len(batch.seqs), device=batch.token_ids.device), batch.query_lens
    )
    return RowPlan(
        batch.slot_mapping, batch.block_tables.contiguous(), row_seq, batch.positions + 1
    )


class CpuMlaAttention(MlaAttention):
    """The absorbed form for every row, decode and prefill alike, in C
    (kernels/mla_attention.c): a row's result does not depend on the batch or the chunk, so a
    token gets the same bits decoded or prefilled."""

    def __init__(self, config: ModelConfig, ops: LayerOps, library: ctypes.CDLL) -> None:
        super().__init__(config, ops)
        p, i64, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._matmul = _bind(
            library.mla_heads_matmul, None, [p, flag, p, flag, p, flag] + [i64] * 4
        )
        # bfloat16 products a pair of terms at a time (AVX512-BF16): the attended latent is
        # rounded to bfloat16 for them
        self._pairs = bool(library.mla_heads_pairs())
        self._attend = _bind(
            library.mla_attend, flag, [p, p, flag, p, p, p, p] + [i64] * 5 + [ctypes.c_float]
        )

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
        if k_cache.shape[-1] != KERNEL_BLOCK_SIZE:
            raise ValueError(f"the MLA kernel reads {KERNEL_BLOCK_SIZE}-token blocks")
        m = self.mla
        q_nope, q_pe, latent = self.project(layer, x, cos_sin)
        none = latent.new_empty(latent.shape[0], 1, 0)
        kv_cache.write(k_cache, v_cache, plan.slots, latent[:, None, :], none)
        q_lat = self.heads_matmul(q_nope.contiguous(), layer.k_up, torch.float32)
        query = torch.cat((q_lat, q_pe.float()), dim=-1)  # [T, heads, latent_dim]
        rows, heads = query.shape[:2]
        attended = query.new_empty(rows, heads, m.kv_lora_rank)
        status = self._attend(
            query.data_ptr(), k_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
            plan.tables.data_ptr(), plan.row_seq.data_ptr(), plan.lens.data_ptr(),
            attended.data_ptr(), rows, heads, m.latent_dim, m.kv_lora_rank,
            plan.tables.shape[1], self.scale,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError("MLA attention kernel failed (sizes out of range or no memory)")
        if self._pairs and layer.v_up.dtype == torch.bfloat16:
            attended = attended.to(torch.bfloat16)  # as the expanded form's values would be
        out = self.heads_matmul(attended, layer.v_up, x.dtype)  # [T, heads, v]
        return layer.o(out.flatten(1))

    def heads_matmul(self, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x [T, H, N] times w [H, N, C] per head -> [T, H, C] in `dtype`."""
        rows, heads, n = x.shape
        out = x.new_empty(rows, heads, w.shape[2], dtype=dtype)
        self._matmul(
            x.data_ptr(), int(x.dtype == torch.bfloat16), w.data_ptr(),
            int(w.dtype == torch.bfloat16), out.data_ptr(), int(dtype == torch.bfloat16),
            rows, heads, n, w.shape[2],
        )  # fmt: skip
        return out


def _bind(fn: Any, restype: Any, argtypes: list[Any]) -> Any:
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


def default_mla_attention(
    config: ModelConfig, ops: LayerOps, device: torch.device, dtype: torch.dtype, kernels: str
) -> MlaAttention:
    """The C kernels on CPUs where they build, for float32 and bfloat16 and the shapes they
    take (latent and value widths in whole vectors, 16-token blocks); else the torch
    reference. (Triton's are in families/deepseek/triton_mla.py; DeepseekModel takes them for
    `--kernels triton`.)"""
    from services.model.layers.attention import resolve_kernels

    m = mla_of(config)
    if resolve_kernels(kernels, device) == "c" and dtype in (torch.float32, torch.bfloat16):
        library = libraries.load("mla_attention")
        if library is not None:
            lanes = library.mla_attention_lanes()
            fits = m.kv_lora_rank % lanes == 0 and m.v_dim % lanes == 0
            if fits:
                return CpuMlaAttention(config, ops, library)
    return MlaAttention(config, ops)
