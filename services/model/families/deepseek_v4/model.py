"""DeepSeek-V4 (`DeepseekV4ForCausalLM`) over the paged pool: hyper-connected residual streams,
V4 attention (attention.py) and mixtures of experts routed by a token table (hash) or by
top-k of sqrt(softplus) scores, experts' SwiGLU clamped.

The residual is `hc_mult` streams per token. Before each block (attention, then MoE) a mix
computed from the streams (float32) collapses them into the block's input; after it, the
block's output is spread back (`post`) and the streams mixed by a Sinkhorn-normalized matrix
(`comb`). The head collapses them once more. Same interface as DecoderModel: `forward(batch,
kv)` -> logits, `new_kv_cache`, `expert_counts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvstore.block_hash import BLOCK_SIZE
from services.model.batch import ForwardBatch
from services.model.causal_lm import Capabilities
from services.model.config import ModelConfig
from services.model.families.base import PagedModel
from services.model.families.deepseek_v4 import quant as v4_quant
from services.model.families.deepseek_v4.attention import (
    Compressor,
    V4Attention,
    V4AttentionWeights,
    _unweighted_rms_norm,
)
from services.model.families.deepseek_v4.config import CSA, SLIDING, row_layout, v4_of
from services.model.families.deepseek_v4.rows import Pools, V4Rope
from services.model.kv_cache import KVCache
from services.model.layers import pointwise
from services.model.layers.layer_ops import LayerOps, TorchLayerOps, rms_norm_f32
from services.model.layers.linear import Linear
from services.model.layers.moe import DenseMlp, Moe, built_experts
from services.model.layers.rope import Rotary


@dataclass(frozen=True)
class HyperConnection:
    """One block's stream mixing: fn [(2 + N) N, N D] as a float32 product, base, scale [3]."""

    fn: Linear
    base: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class V4Layer:
    attn_hc: HyperConnection
    attn_norm: torch.Tensor  # float32
    attention: V4AttentionWeights
    ffn_hc: HyperConnection
    ffn_norm: torch.Tensor  # float32
    moe: V4Moe


@dataclass(frozen=True)
class ClampedMlp(DenseMlp):
    """SwiGLU with the gate clamped above and up clamped both ways at `limit` (0: none)."""

    limit: float = 0.0

    def __call__(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.down(pointwise.silu(gate) * up)


class V4Moe(Moe):
    """Routed by tid2eid[token] (hash layers) or top-k of scores + correction bias; weights
    are the chosen experts' scores, renormalized, times routed_scaling_factor."""

    def __init__(self, *args: object, tid2eid: torch.Tensor | None, scoring: str, **kw: object):
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.tid2eid = tid2eid
        self.scoring = scoring

    def forward(self, x: torch.Tensor, ops: LayerOps, token_ids: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float()  # [T, experts]
        if self.scoring == "sqrtsoftplus":
            scores = pointwise.softplus(logits).sqrt()
        else:
            scores = pointwise.sigmoid(logits)
        if self.tid2eid is not None:
            ids = self.tid2eid[token_ids]
        else:
            assert self.correction_bias is not None
            ids = (scores + self.correction_bias).topk(self.shape.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (pointwise.ordered_sum(weights, -1)[:, None] + 1e-20)
        out = self.routed(x, weights * self.shape.routed_scaling_factor, ids, ops)
        assert self.shared is not None
        return out + self.shared(x, ops)


class DeepseekV4Model(PagedModel):
    @classmethod
    def supports(cls, config: ModelConfig) -> Capabilities:
        return Capabilities(hidden_rows=True)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        config, dtype = self.config, self.dtype
        assert config.moe is not None
        self.v4 = v4_of(config)

        def w(name: str, keep_float32: bool = False) -> torch.Tensor:
            t = v4_quant.dequantize(weights, name, config.fp8_block)
            return t.to(self.device, torch.float32 if keep_float32 else dtype)

        def linear(*names: str, keep_float32: bool = False) -> Linear:
            return self.product(torch.cat([w(n, keep_float32) for n in names]))

        self._w, self._linear, self._weights = w, linear, weights
        self._ids = lambda name: weights[name].to(self.device, torch.int64)  # tid2eid
        self.embed = w("embed.weight")
        # an id's embedding row (tensor ranks look it up from the rank holding it)
        self.lookup: Callable[[torch.Tensor], torch.Tensor] = self._lookup
        self.lm_head = self.logits_product(
            w("embed.weight" if config.tie_word_embeddings else "head.weight")
        )
        self.norm = w("norm.weight", True)
        self.head_hc = HyperConnection(
            linear("hc_head_fn", keep_float32=True),
            w("hc_head_base", True),
            w("hc_head_scale", True),
        )
        self.layers = [self._layer(i) for i in range(config.num_layers)]
        self.rows = row_layout(self.v4, config.head_dim)
        self.attention = V4Attention(config, V4Rope(config, dtype, self.device), self.rows)
        # the experts' products are linear.py's; the ops are only passed through to them
        tiny = dataclasses.replace(config, max_position_embeddings=1)
        self.ops: LayerOps = TorchLayerOps(config, Rotary(tiny, dtype, self.device, 2))
        self.hidden: torch.Tensor | None = None

    def _layer(self, i: int) -> V4Layer:
        w, linear, p = self._w, self._linear, f"layers.{i}."

        def hc(kind: str) -> HyperConnection:
            name = p + f"hc_{kind}_"
            return HyperConnection(
                linear(name + "fn", keep_float32=True),
                w(name + "base", True),
                w(name + "scale", True),
            )

        return V4Layer(
            attn_hc=hc("attn"),
            attn_norm=w(p + "attn_norm.weight", True),
            attention=self._attention(i, p + "attn."),
            ffn_hc=hc("ffn"),
            ffn_norm=w(p + "ffn_norm.weight", True),
            moe=self._moe(i, p + "ffn."),
        )

    def _attention(self, i: int, a: str) -> V4AttentionWeights:
        w, linear, v4, c = self._w, self._linear, self.v4, self.config
        kind = v4.layer_types[i]
        x_names = [a + "wq_a.weight", a + "wkv.weight"]
        compressor = indexer = index_q = None
        if kind != SLIDING:
            series = 2 if kind == CSA else 1
            x_names += [a + "compressor.wkv.weight", a + "compressor.wgate.weight"]
            ape, norm = w(a + "compressor.ape", True), w(a + "compressor.norm.weight", True)
            compressor = Compressor(v4.rate(i), c.head_dim, series, ape, norm, c.rms_norm_eps)
        if kind == CSA:
            ix = a + "indexer."
            x_names += [ix + "compressor.wkv.weight", ix + "compressor.wgate.weight",
                        ix + "weights_proj.weight"]  # fmt: skip
            ape, norm = w(ix + "compressor.ape", True), w(ix + "compressor.norm.weight", True)
            indexer = Compressor(v4.csa_rate, v4.index_dim, 2, ape, norm, c.rms_norm_eps)
            index_q = linear(ix + "wq_b.weight")
        o_a = w(a + "wo_a.weight").view(v4.o_groups, v4.o_lora_rank, -1)
        return V4AttentionWeights(
            kind=kind,
            x_proj=linear(*x_names),
            q_a_norm=w(a + "q_norm.weight", True),
            q_b=linear(a + "wq_b.weight"),
            kv_norm=w(a + "norm.weight", True),
            o_a=[self.product(g) for g in o_a],
            o_b=linear(a + "wo_b.weight"),
            sinks=w(a + "attn_sink", True),
            compressor=compressor,
            indexer=indexer,
            index_q=index_q,
        )

    def _moe(self, i: int, f: str) -> V4Moe:
        w, linear, moe, v4 = self._w, self._linear, self.config.moe, self.v4
        assert moe is not None

        def mlp(e: str) -> ClampedMlp:
            gate_up = linear(e + "w1.weight", e + "w3.weight")
            return ClampedMlp(gate_up, linear(e + "w2.weight"), v4.swiglu_limit)

        hashed = i in v4.hash_layers
        return V4Moe(
            moe,
            linear(f + "gate.weight"),
            self.dtype,
            None if hashed else w(f + "gate.bias", True),
            built_experts(moe.num_experts, lambda e: mlp(f"{f}experts.{e}."), self._weights),
            mlp(f + "shared_experts."),
            None,
            build=lambda e: mlp(f"{f}experts.{e}."),
            tid2eid=self._ids(f + "gate.tid2eid") if hashed else None,
            scoring=v4.scoring,
        )

    def moe_layers(self) -> dict[int, Moe]:
        return {i: layer.moe for i, layer in enumerate(self.layers)}

    def new_kv_cache(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        group_blocks: Mapping[str, int] | None = None,
    ) -> KVCache:
        if block_size != BLOCK_SIZE:
            raise ValueError(f"DeepSeek-V4's cache rows are laid out for {BLOCK_SIZE}-token blocks")
        return super().new_kv_cache(num_blocks, block_size, group_blocks)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVCache, streams: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] in float32; every row's cache row written.
        `streams` [T, N, hidden]: the first layer's input in place of the tokens' embeddings
        (an MTP layer's); with `keep_hidden`, every row's last streams [T, N hidden] kept in
        `hidden` (the head's input, before its collapse: what an MTP layer reads)."""
        c = self.config
        cache = Pools.of(kv)
        if streams is None:
            h = self.lookup(batch.token_ids)  # [T, hidden]
            streams = h[:, None, :].expand(-1, self.v4.hc_mult, -1).contiguous()  # [T, N, hidden]
        for i, layer in enumerate(self.layers):
            x, post, comb = self._collapse(layer.attn_hc, streams)
            x = rms_norm_f32(x, layer.attn_norm, c.rms_norm_eps)
            out = self.attention.forward(i, layer.attention, x, batch, cache)
            streams = _expand(out, post, comb, streams)
            x, post, comb = self._collapse(layer.ffn_hc, streams)
            x = rms_norm_f32(x, layer.ffn_norm, c.rms_norm_eps)
            streams = _expand(layer.moe.forward(x, self.ops, batch.token_ids), post, comb, streams)
        self.hidden = streams.flatten(1) if self.keep_hidden else None
        rows = streams[batch.logits_rows]
        flat = _unweighted_rms_norm(rows.flatten(1).float(), c.rms_norm_eps)
        pre = pointwise.sigmoid(self.head_hc.fn(flat) * self.head_hc.scale + self.head_hc.base)
        x = pointwise.ordered_sum((pre + self.v4.hc_eps)[..., None] * rows, 1).to(self.dtype)
        return self.lm_head(rms_norm_f32(x, self.norm, c.rms_norm_eps)).float()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed.index_select(0, ids)

    def _collapse(
        self, hc: HyperConnection, streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block input [T, hidden], post [T, N] and comb [T, N, N] (float32)."""
        n, eps = self.v4.hc_mult, self.v4.hc_eps
        flat = _unweighted_rms_norm(streams.flatten(1).float(), self.config.rms_norm_eps)
        mix = hc.fn(flat)  # [T, (2 + N) N]
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
        pre = pointwise.sigmoid(pre_w * hc.scale[0] + pre_b) + eps
        post = 2 * pointwise.sigmoid(post_w * hc.scale[1] + post_b)
        comb = pointwise.softmax(comb_w.view(-1, n, n) * hc.scale[2] + comb_b.view(n, n), -1)
        comb = comb + eps
        comb = comb / (pointwise.ordered_sum(comb, -2)[:, None, :] + eps)  # columns
        for _ in range(self.v4.hc_iters - 1):
            comb = comb / (pointwise.ordered_sum(comb, -1)[..., None] + eps)  # rows
            comb = comb / (pointwise.ordered_sum(comb, -2)[:, None, :] + eps)
        collapsed = pointwise.ordered_sum(pre[..., None] * streams, 1).to(streams.dtype)
        return collapsed, post, comb


def _expand(
    out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor
) -> torch.Tensor:
    """Stream k becomes post_k * out + sum_j comb[j, k] * stream_j (in the model's dtype)."""
    dtype = streams.dtype
    mixed = pointwise.ordered_sum(comb.to(dtype).transpose(1, 2)[..., None] * streams[:, None], 2)
    return post.to(dtype)[..., None] * out[:, None, :] + mixed
