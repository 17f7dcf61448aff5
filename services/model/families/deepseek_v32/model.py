"""DeepSeek-V3.2 over the paged cache: DeepSeek-V3's model (families/deepseek/) whose attention
reads, for each query, only the earlier tokens the lightning indexer picks.

Per layer and query row t (position p):

    q_resid = q_a_norm(q_a_proj(x))                    (the query's LoRA, shared with MLA)
    iq = rope(wq_b(q_resid))  [index_heads, D]         rotate-half over the first rope_dim
    ik = rope(LayerNorm(wk(x)))  [D]                   cached: the "indexer" group
    score(s) = sum_h w_h relu(iq_h . ik_s / sqrt(D)),  w = weights_proj(x) / sqrt(index_heads)
    keys(t) = every s <= p, or the index_topk with the highest score(s) past that many
    attention: latent attention (absorbed form) over keys(t) only

Each row is computed alone, on tensors of its own shape (its context read back from the
cache), so its bits depend on its own tokens: the same decoded or prefilled, alone or batched.
The indexer and the sparse attention run in torch (no C or Triton kernel takes a list of keys
per row in latent space yet: docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from services.model import kv_cache
from services.model.batch import ForwardBatch
from services.model.causal_lm import Capabilities
from services.model.config import ModelConfig
from services.model.families.deepseek.mla import MlaAttention, MlaWeights
from services.model.families.deepseek.model import DeepseekModel
from services.model.families.deepseek_v32.config import INDEXER, LATENT, V32Shape, v32_of
from services.model.families.llama.model import LinearFn, WeightFn
from services.model.kv_cache import KVCache
from services.model.layers.linear import Linear
from services.model.layers.rope import apply_rotary, apply_rotary_pairs

INDEX_NORM_EPS = 1e-6  # the indexer's key LayerNorm


@dataclass(frozen=True)
class IndexerWeights:
    wq_b: Linear  # q_lora_rank -> index_heads * index_dim
    wk: Linear  # hidden -> index_dim
    k_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias [index_dim]
    weights_proj: Linear  # hidden -> index_heads


@dataclass(frozen=True)
class V32Weights(MlaWeights):
    """A layer's latent attention and its indexer."""

    indexer: IndexerWeights | None = None


class DeepseekV32Model(DeepseekModel):
    @classmethod
    def supports(cls, config: ModelConfig) -> Capabilities:
        return Capabilities()

    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.indexed = IndexedAttention(config, MlaAttention(config, self.ops))

    def _attention_weights(self, p: str, w: WeightFn, linear: LinearFn) -> V32Weights:
        mla = super()._attention_weights(p, w, linear)
        i = p + "indexer."
        indexer = IndexerWeights(
            wq_b=linear(i + "wq_b"),
            wk=linear(i + "wk"),
            k_norm=(w(i + "k_norm.weight"), w(i + "k_norm.bias")),
            weights_proj=linear(i + "weights_proj"),
        )
        return V32Weights(**{f.name: getattr(mla, f.name) for f in fields(mla)}, indexer=indexer)

    def _plan(self, batch: ForwardBatch) -> tuple[object, object]:
        return batch, self.mla_rotary.tables(batch.positions)

    def _attention(
        self, i: int, layer: Any, x: torch.Tensor, at: object, kv: KVCache, plan: object
    ) -> torch.Tensor:
        assert isinstance(plan, ForwardBatch) and isinstance(at, tuple)
        latents, index = kv.group(LATENT).layer(i), kv.group(INDEXER).layer(i)
        return self.indexed.forward(layer, x, at, latents, index, plan)


class IndexedAttention:
    def __init__(self, config: ModelConfig, mla: MlaAttention) -> None:
        self.config, self.mla = config, mla
        self.shape: V32Shape = v32_of(config)
        # a tensor rank's heads: (the first's place among all heads, all heads; tensor.py)
        self.heads_at: tuple[int, int] | None = None

    def forward(
        self,
        layer: V32Weights,
        x: torch.Tensor,  # [T, hidden], normed
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, 1, rope_dim] each
        latents: tuple[torch.Tensor, torch.Tensor],  # the layer's latent group: K, V (none)
        index: tuple[torch.Tensor, torch.Tensor],  # its indexer group: K, V (none)
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, hidden]
        m, heads = self.shape, self.config.num_heads
        w = layer
        assert w.indexer is not None
        a = w.qkv_a(x)
        q, kv = a.split([a.shape[1] - m.latent_dim, m.latent_dim], dim=-1)
        assert w.q_b is not None and w.q_a_norm is not None
        q_resid = self.mla._norm(q, w.q_a_norm)  # [T, q_lora_rank]
        q = w.q_b(q_resid).reshape(-1, heads, m.nope_dim + m.rope_dim)
        q_nope, q_pe = q.split([m.nope_dim, m.rope_dim], dim=-1)
        c, k_pe = kv.split([m.kv_lora_rank, m.rope_dim], dim=-1)
        cos, sin = cos_sin
        rotate = apply_rotary_pairs if m.rope_pairs else apply_rotary
        q_pe = rotate(q_pe, cos, sin)
        k_pe = rotate(k_pe[:, None, :], cos, sin)[:, 0]
        latent = torch.cat((self.mla._norm(c, w.kv_a_norm), k_pe), dim=-1)  # [T, latent_dim]
        iq, ik, iw = self._index_rows(w.indexer, x, q_resid, cos, sin)
        for cache, rows in ((latents, latent), (index, ik)):
            none = rows.new_empty(rows.shape[0], 1, 0)
            kv_cache.write(*cache, batch.slot_mapping, rows[:, None, :], none)
        out = q_nope.new_empty(q_nope.shape[0], heads, m.v_dim)
        for span in batch.seqs:
            context, _ = kv_cache.gather(*latents, span.block_table)  # [n, 1, latent_dim]
            keys, _ = kv_cache.gather(*index, span.block_table)  # [n, 1, index_dim]
            start = span.context_len - span.query_len
            for j in range(span.query_len):
                r, p = span.row + j, start + j
                chosen = self._choose(iq[r], iw[r], keys[:, 0], p + 1)
                q_lat = torch.einsum("hn,hnc->hc", q_nope[r], w.k_up)  # [heads, kv_lora]
                query = torch.cat((q_lat, q_pe[r]), dim=-1)  # [heads, latent_dim]
                out[r] = self._attend(query, context[chosen, 0], w.v_up)
        return w.o(out.flatten(1))

    def _index_rows(
        self,
        w: IndexerWeights,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' indexer queries [T, index_heads, D], keys [T, D] (both rotated) and head
        weights [T, index_heads] (float32, scaled)."""
        m = self.shape
        q = w.wq_b(q_resid).reshape(-1, m.index_heads, m.index_dim)
        k = F.layer_norm(w.wk(x), (m.index_dim,), *w.k_norm, INDEX_NORM_EPS)
        r = m.rope_dim
        q = torch.cat((apply_rotary(q[..., :r], cos, sin), q[..., r:]), dim=-1)
        k = torch.cat((apply_rotary(k[:, None, :r], cos, sin)[:, 0], k[:, r:]), dim=-1)
        weights = w.weights_proj(x).float() * m.index_heads**-0.5
        return q, k, weights

    def _choose(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: int
    ) -> torch.Tensor:
        """The positions a row attends to, ascending: its first `visible` positions up to
        index_topk of them, else the index_topk its indexer scores highest.

        `keys` [n, D] are the sequence's keys as far as this pass computes them: exact ties
        (positions every head scores at or below zero) are broken as transformers breaks them,
        by torch.topk over all of them, those not yet visible at -inf. So a prompt prefilled in
        one pass, its decode and a prefix found in a cache choose as transformers does; a
        chunk boundary inside the prompt can break such a tie otherwise, as it can there."""
        topk = self.shape.index_topk
        if visible <= topk:
            return torch.arange(visible, device=keys.device)
        scores = (q.float() @ keys.float().T) * self.shape.index_dim**-0.5  # [heads, n]
        index = (weights[None, :] @ F.relu(scores))[0]  # [n]
        index[visible:] = float("-inf")
        chosen = index.topk(min(topk, keys.shape[0])).indices
        return chosen[chosen < visible].sort().values

    def _attend(
        self, query: torch.Tensor, latents: torch.Tensor, v_up: torch.Tensor
    ) -> torch.Tensor:
        """query [heads, latent_dim] over latents [k, latent_dim] in the absorbed form ->
        [heads, v_dim]. A tensor rank takes the products over the heads at the whole head
        count, its heads at their own rows (a GEMM row's bits depend on the row count)."""
        heads = mine = len(query)
        if self.heads_at is not None:
            first, heads = self.heads_at
            whole = query.new_zeros(heads, query.shape[1])
            whole[first : first + mine] = query
            query = whole
        scores = (query.float() @ latents.float().T) * self.mla.scale  # [heads, k]
        attended = scores.softmax(dim=-1) @ latents[:, : self.shape.kv_lora_rank].float()
        if self.heads_at is not None:
            attended = attended[self.heads_at[0] :][:mine]
        return torch.einsum("hc,hcv->hv", attended.to(query.dtype), v_up)
