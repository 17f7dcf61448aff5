"""DeepSeek-V4's attention over its cache rows: a sliding window of one shared K=V head with a
sink per head, plus compressed entries (all causal ones in HCA layers, the indexer's top-k in
CSA layers), then the grouped output projection. The torch reference: each query row is
computed on its own, over the keys it sees, so its bits never depend on the batch or on how
the prompt was chunked.

One layer's forward, for the rows of a batch:

    1. project: q (normed, rotated), kv (normed, rotated), the compressors' raw inputs
    2. write each row's kv and raw inputs into its cache row
    3. compress: every row that closes a window ((t + 1) % rate == 0) makes entry
       (t + 1) / rate - 1 from the raw inputs in the cache, and writes it as shares
    4. attend: each row over its window, its entries and the sink; de-rotate; project out
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model.batch import ForwardBatch, SeqSpan
from services.model.config import ModelConfig
from services.model.families.deepseek_v4 import rows as v4_rows
from services.model.families.deepseek_v4.config import SLIDING, LayerRow, v4_of
from services.model.families.deepseek_v4.rows import Pools, V4Rope, slots_of
from services.model.layers import pointwise
from services.model.layers.layer_ops import rms_norm_f32
from services.model.layers.linear import Linear
from services.model.layers.row_attention import attend_rows


@dataclass(frozen=True)
class Compressor:
    """Pools `rate` tokens' raw kv by a softmax over its gate (plus a bias per slot), channel
    by channel; CSA's two series overlap (entry e also pools the previous window's first
    half). The result is RMS-normed and rotated to the window's first position."""

    rate: int
    dim: int  # width of an entry
    series: int  # 2: CSA's overlapping pair, 1: HCA
    bias: torch.Tensor  # ape [rate, series * dim], float32
    norm: torch.Tensor  # [dim], float32
    eps: float

    def entries(self, a: torch.Tensor, z: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """a, z [n, (series) * rate, series * dim]: raw kv and gate of the tokens each entry
        pools (for CSA the previous window's, then its own; `first` [n] marks entries with
        no previous window); -> [n, dim], before rope."""
        m, d = self.rate, self.dim
        gate = z.float() + self.bias.repeat(self.series, 1)  # [n, slots, series * dim]
        if self.series == 2:  # slots 0..m-1 take series A of the previous window, then B
            a = torch.cat((a[:, :m, :d], a[:, m:, d:]), dim=1)
            gate = torch.cat((gate[:, :m, :d], gate[:, m:, d:]), dim=1)
            a[first, :m] = 0
            gate[first, :m] = float("-inf")
        weights = pointwise.softmax(gate, 1).to(a.dtype)
        return rms_norm_f32(pointwise.ordered_sum(a * weights, 1), self.norm, self.eps)


@dataclass(frozen=True)
class V4AttentionWeights:
    kind: str  # config.LAYER_TYPES
    x_proj: Linear  # hidden -> q_lora | kv | compressor kv, gate | indexer kv, gate | weights
    q_a_norm: torch.Tensor  # [q_lora], float32
    q_b: Linear  # q_lora -> heads * head_dim
    kv_norm: torch.Tensor  # [head_dim], float32
    o_a: list[Linear]  # per group: heads / groups * head_dim -> o_lora_rank
    o_b: Linear  # groups * o_lora_rank -> hidden
    sinks: torch.Tensor  # [heads], float32
    compressor: Compressor | None
    indexer: Compressor | None  # CSA: the indexer keys' own compressor
    index_q: Linear | None  # CSA: q_lora -> index_heads * index_dim


class V4Attention:
    def __init__(self, config: ModelConfig, rope: V4Rope, rows: tuple[LayerRow, ...]) -> None:
        self.config, self.v4, self.rope, self.rows = config, v4_of(config), rope, rows
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        layer: int,
        w: V4AttentionWeights,
        x: torch.Tensor,  # [T, hidden], normed
        batch: ForwardBatch,
        cache: Pools,
    ) -> torch.Tensor:  # [T, hidden]
        c, v4, row = self.config, self.v4, self.rows[layer]
        kind = "main" if w.kind == SLIDING else "compress"
        cos, sin = self.rope.tables(batch.positions, kind)
        parts = w.x_proj(x)
        q_lat, kv, raw, index_w = parts.split(
            [
                v4.q_lora_rank,
                c.head_dim,
                row.raw,
                parts.shape[1] - v4.q_lora_rank - c.head_dim - row.raw,
            ],
            dim=-1,
        )
        q_lat = rms_norm_f32(q_lat, w.q_a_norm, c.rms_norm_eps)
        q = _unweighted_rms_norm(w.q_b(q_lat).view(-1, c.num_heads, c.head_dim), c.rms_norm_eps)
        q = self.rope.apply(q, cos, sin)
        kv = self.rope.apply(rms_norm_f32(kv, w.kv_norm, c.rms_norm_eps), cos, sin)
        slots = batch.slots(cache.window_table)
        v4_rows.write(cache.window, slots, row.offset, torch.cat((kv, raw), dim=-1))
        if w.compressor is not None:
            self._compress(w, row, batch, cache)
        index_q = None
        if w.index_q is not None:
            index_q = self.rope.apply(
                w.index_q(q_lat).view(-1, v4.index_heads, v4.index_dim), cos, sin
            )
        keys, lists, base = [], [], 0  # every sequence's keys in one buffer; each row's list
        for span in batch.seqs:
            rows = slice(span.row, span.row + span.query_len)
            iq = None if index_q is None else (index_q[rows], index_w[rows])
            seq_keys, seq_lists = self._keys_seq(w, row, span, iq, batch.block_size, cache)
            keys.append(seq_keys)
            lists += [i + base for i in seq_lists]
            base += len(seq_keys)
        kv_rows = torch.cat(keys)[:, None]  # one K=V head
        out = attend_rows(q, kv_rows, kv_rows, lists, self.scale, w.sinks)
        out = self.rope.apply(out, cos, -sin)  # each key counts by its distance to the query
        groups = out.view(out.shape[0], v4.o_groups, -1)
        return w.o_b(torch.cat([o(groups[:, g]) for g, o in enumerate(w.o_a)], dim=-1))

    def _compress(
        self, w: V4AttentionWeights, row: LayerRow, batch: ForwardBatch, cache: Pools
    ) -> None:
        """Make the entries this batch's rows close, from the raw inputs in the cache, and
        write each as shares into the rows of the `span` tokens ending at its closing one."""
        comp = w.compressor
        assert comp is not None
        m, bs = comp.rate, batch.block_size
        closing: list[torch.Tensor] = []  # per sequence: the entries its new rows close
        for span in batch.seqs:
            start = span.context_len - span.query_len
            # entry e closes at token (e + 1) m - 1: those among the new rows
            first, end = -(-(start + 1) // m) - 1, span.context_len // m
            closing.append(torch.arange(first, end, device=batch.positions.device))
        entries = []
        for span, es in zip(batch.seqs, closing, strict=True):
            if len(es):
                entries.append(self._entries(w, row, span.table(cache.window_table), es, bs, cache))
        if not entries:
            return
        values = torch.cat(entries)  # [n, entry]
        share_slots = torch.cat(
            [
                slots_of(
                    span.block_table,
                    ((es + 1) * m)[:, None] - torch.arange(row.span, 0, -1, device=es.device),
                    bs,
                ).flatten()
                for span, es in zip(batch.seqs, closing, strict=True)
                if len(es)
            ]
        )
        padded = values.new_zeros(values.shape[0], row.span * row.share)
        padded[:, : row.entry] = values
        v4_rows.write(cache.shares, share_slots, row.share_at, padded.view(-1, row.share))

    def _entries(
        self,
        w: V4AttentionWeights,
        row: LayerRow,
        table: torch.Tensor,  # the sequence's window table
        es: torch.Tensor,  # [n] entry indices
        bs: int,
        cache: Pools,
    ) -> torch.Tensor:  # [n, entry]: the key, then (CSA) the indexer key
        comp = w.compressor
        assert comp is not None
        m, series = comp.rate, comp.series
        # the tokens each entry pools: for CSA the previous window's too (clamped at 0, masked)
        lo = (es - (series - 1)) * m
        positions = (lo[:, None] + torch.arange(series * m, device=es.device)).clamp(min=0)
        raw = v4_rows.read(
            cache.window, slots_of(table, positions.flatten(), bs), row.offset + row.kv, row.raw
        )
        raw = raw.view(len(es), series * m, row.raw)
        first = es == 0
        d = comp.dim * series
        out = [self._rope_entries(comp.entries(raw[..., :d], raw[..., d : 2 * d], first), es, m)]
        if w.indexer is not None:
            i = w.indexer
            ia, iz = raw[..., 2 * d : 2 * d + 2 * i.dim], raw[..., 2 * d + 2 * i.dim :]
            out.append(self._rope_entries(i.entries(ia, iz, first), es, m))
        return torch.cat(out, dim=-1)

    def _rope_entries(self, pooled: torch.Tensor, es: torch.Tensor, m: int) -> torch.Tensor:
        cos, sin = self.rope.tables(es * m, "compress")  # the window's first position
        return self.rope.apply(pooled, cos, sin)

    def _keys_seq(
        self,
        w: V4AttentionWeights,
        row: LayerRow,
        span: SeqSpan,
        index: tuple[torch.Tensor, torch.Tensor] | None,  # indexer q [n, ih, id], weights
        bs: int,
        cache: Pools,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A sequence's keys [window rows | entries] and each new row's list of them: its
        window, then its entries (all visible ones, or the indexer's choice)."""
        c, window = self.config, self.v4.window
        start = span.context_len - span.query_len
        lo = max(0, start - window + 1)
        device = span.block_table.device
        positions = torch.arange(lo, span.context_len, device=device)
        slots = slots_of(span.table(cache.window_table), positions, bs)
        kv = v4_rows.read(cache.window, slots, row.offset, c.head_dim)
        windows = [
            torch.arange(max(0, t - window + 1) - lo, t + 1 - lo)
            for t in range(start, span.context_len)
        ]
        if w.compressor is None:
            return kv, windows
        m, n = w.compressor.rate, len(kv)
        every = torch.arange(span.context_len // m, device=device)
        new = range(start, span.context_len)
        if w.indexer is None or index is None:  # HCA: every entry so far, each row its visible
            entries = self._read_entries(row, span, m, bs, cache, every, 0, c.head_dim)
            lists = [
                torch.cat((own, n + torch.arange((t + 1) // m)))
                for t, own in zip(new, windows, strict=True)
            ]
            return torch.cat((kv, entries)), lists
        # CSA: the indexer reads every entry's indexer key; the keys of its choices are read
        index_keys = self._read_entries(row, span, m, bs, cache, every, c.head_dim, row.entry)
        chosen = [
            _top_k(index[0][i], index[1][i], index_keys, (t + 1) // m, self.v4.index_topk)
            for i, t in enumerate(new)
        ]
        used = torch.unique(torch.cat(chosen)) if chosen else every[:0]
        entries = self._read_entries(row, span, m, bs, cache, used, 0, c.head_dim)
        lists = [
            torch.cat((own, n + torch.searchsorted(used, pick).cpu()))
            for own, pick in zip(windows, chosen, strict=True)
        ]
        return torch.cat((kv, entries)), lists

    def _read_entries(
        self,
        row: LayerRow,
        span: SeqSpan,
        m: int,
        bs: int,
        cache: Pools,
        entries: torch.Tensor,  # [n] which entries
        lo: int = 0,
        hi: int | None = None,
    ) -> torch.Tensor:  # [n, hi - lo]: elements [lo, hi) of each (key, then indexer key)
        """Entries read back from their shares: only the tokens holding elements [lo, hi)."""
        hi = row.entry if hi is None else hi
        first, last = lo // row.share, (hi - 1) // row.share + 1  # the shares holding them
        pieces = torch.arange(first, last, device=entries.device)
        tokens = (entries[:, None] + 1) * m - row.span + pieces  # [n, pieces]
        slots = slots_of(span.block_table, tokens.flatten(), bs)
        shares = v4_rows.read(cache.shares, slots, row.share_at, row.share)
        part = shares.view(len(entries), (last - first) * row.share)
        return part[:, lo - first * row.share : hi - first * row.share]


def _top_k(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: int, k: int
) -> torch.Tensor:
    """The indexer's choice for one query: sum over heads h of weights_h * ReLU(q_h . key)
    / sqrt(dim), the top k of the `visible` first entries, in entry order.

    Exact ties (entries every head scores at or below zero) are broken as transformers breaks
    them: torch.topk over all the entries the sequence has at the end of this pass, those not
    yet visible at -inf. So a prompt prefilled in one pass, its decode, and a prefix found in
    the cache choose as transformers does; a chunk boundary inside the prompt can break such a
    tie differently, as it can in transformers."""
    heads, dim = q.shape
    scores = torch.relu(q.float() @ keys.float().T) * dim**-0.5  # [heads, entries]
    total = (scores * (weights.float() * heads**-0.5)[:, None]).sum(dim=0)
    total[visible:] = float("-inf")
    chosen = total.topk(min(k, keys.shape[0])).indices
    return chosen[chosen < visible].sort().values


def _unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
