"""gpt-oss (`GptOssForCausalLM`) over the paged pool: per-head K and V as Llama's
(kv_cache.py's layout, so blocks, the store and the seam are the usual ones), each layer's
attention full or over a sliding window, with a learned sink per head
(row_attention.attend_row, one query row at a time); experts in every layer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from services.model import kv_cache
from services.model.batch import ForwardBatch
from services.model.families.base import PagedModel
from services.model.families.gpt_oss.config import oss_of
from services.model.kv_cache import KVCache
from services.model.layers import pointwise
from services.model.layers.layer_ops import LayerOps, TorchLayerOps, rms_norm_f32
from services.model.layers.linear import Linear
from services.model.layers.moe import DenseMlp, Moe, built_experts
from services.model.layers.rope import Rotary, apply_rotary
from services.model.layers.row_attention import attend_paged


@dataclass(frozen=True)
class OssMlp(DenseMlp):
    """gpt-oss's expert: gate clamped above, up both ways, out = (up + 1) * gate *
    sigmoid(alpha * gate)."""

    limit: float = 7.0
    alpha: float = 1.702

    def __call__(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        glu = gate * pointwise.sigmoid(gate * self.alpha).to(gate.dtype)
        return self.down((up + 1) * glu)


class OssMoe(Moe):
    """Top-k of the router's logits (it has a bias), their softmax as the weights."""

    def route(self, x: torch.Tensor, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        top = self.gate(x).topk(self.shape.top_k, dim=-1)
        return pointwise.softmax(top.values, -1), top.indices


@dataclass(frozen=True)
class OssLayer:
    input_norm: torch.Tensor
    qkv: Linear  # with biases
    o: Linear
    sinks: torch.Tensor  # [heads]
    window: int | None
    post_norm: torch.Tensor
    moe: OssMoe


class GptOssModel(PagedModel):
    def load(self, weights: dict[str, torch.Tensor]) -> None:
        config = self.config
        assert config.moe is not None
        oss = oss_of(config)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device, self.dtype)

        linear = self.product

        self.embed = w("model.embed_tokens.weight")
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        self.lm_head = self.logits_product(w(head + ".weight"))
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            qkv = [w(f"{a}{x}_proj.weight") for x in "qkv"]
            qkv_bias = [w(f"{a}{x}_proj.bias") for x in "qkv"]
            self.layers.append(
                OssLayer(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=linear(torch.cat(qkv), torch.cat(qkv_bias)),
                    o=linear(w(a + "o_proj.weight"), w(a + "o_proj.bias")),
                    sinks=w(a + "sinks"),
                    window=oss.windows[i],
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    moe=self._moe(p + "mlp.", w, linear, weights),
                )
            )
        self.rotary = Rotary(config, self.dtype, self.device)
        self.ops: LayerOps = TorchLayerOps(config, self.rotary)

    def _moe(
        self,
        m: str,
        w: Callable[[str], torch.Tensor],
        linear: Callable[..., Linear],
        weights: Mapping[str, torch.Tensor],
    ) -> OssMoe:
        oss, moe = oss_of(self.config), self.config.moe
        assert moe is not None
        gate_up, gate_up_bias = w(m + "experts.gate_up_proj"), w(m + "experts.gate_up_proj_bias")
        down, down_bias = w(m + "experts.down_proj"), w(m + "experts.down_proj_bias")

        def expert(e: int, stacked: tuple[torch.Tensor, ...] | None = None) -> DenseMlp:
            # the layer's experts are stacked in four tensors; one expert alone reads them anew
            gate_up, gate_up_bias, down, down_bias = stacked or (
                w(m + f"experts.{name}")
                for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
            )
            # [hidden, 2 ff], gate and up columns interleaved
            weight = torch.cat((gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T))
            bias = torch.cat((gate_up_bias[e][0::2], gate_up_bias[e][1::2]))
            return OssMlp(
                linear(weight, bias),
                linear(down[e].T, down_bias[e]),
                oss.swiglu_limit,
                oss.swiglu_alpha,
            )

        stacked = (gate_up, gate_up_bias, down, down_bias)
        experts = built_experts(moe.num_experts, lambda e: expert(e, stacked), weights)
        router = linear(w(m + "router.weight"), w(m + "router.bias"))
        return OssMoe(moe, router, self.dtype, None, experts, None, None, build=expert)

    def moe_layers(self) -> dict[int, Moe]:
        return {i: layer.moe for i, layer in enumerate(self.layers)}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        c = self.config
        cos, sin = self.rotary.tables(batch.positions)
        h = self.embed.index_select(0, batch.token_ids)
        for i, layer in enumerate(self.layers):
            x = rms_norm_f32(h, layer.input_norm, c.rms_norm_eps)
            q, k, v = layer.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = apply_rotary(q.reshape(-1, c.num_heads, c.head_dim), cos, sin)
            k = apply_rotary(k.reshape(-1, c.num_kv_heads, c.head_dim), cos, sin)
            v = v.reshape(-1, c.num_kv_heads, c.head_dim)
            group = kv.group_of(i)
            k_cache, v_cache = group.layer(i)
            kv_cache.write(k_cache, v_cache, batch.slots(group.index), k, v)
            scale = c.head_dim**-0.5
            out = attend_paged(
                q, k_cache, v_cache, batch, scale, layer.window, layer.sinks, group.index
            )
            h = h + layer.o(out.flatten(1))
            x = rms_norm_f32(h, layer.post_norm, c.rms_norm_eps)
            h = h + layer.moe(x, self.ops)
        x = rms_norm_f32(h[batch.logits_rows], self.norm, c.rms_norm_eps)
        return self.lm_head(x).float()
