"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Weights are arranged once at load time: q/k/v fused into one matrix and gate/up into another,
so a layer runs four matrix multiplies, each in the device's fastest layout (`linear.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model.attention import Attention, default_attention
from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache
from services.model.linear import Linear, make_linear, packed_linear_available
from services.model.rope import Rotary, apply_rotary


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q + 2 kv
    o: Linear  # q -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 ff
    down: Linear  # ff -> hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # statistics in float32 whatever the compute dtype, as transformers does
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention: Attention | None = None,
        packed: bool | None = None,
    ) -> None:
        """`packed`: oneDNN-prepacked weights (default: wherever they work, i.e. CPUs)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.attention: Attention = attention or default_attention(
            self.device, dtype, config.head_dim, config.num_heads // config.num_kv_heads
        )
        if packed is None:
            packed = packed_linear_available(self.device, dtype)
        self.packed = packed

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        def linear(*names: str, bias: bool = False) -> Linear:
            # several [out, in] matrices stacked into one [sum(out), in]
            weight = torch.cat([w(n + ".weight") for n in names], dim=0)
            b = torch.cat([w(n + ".bias") for n in names]) if bias else None
            return make_linear(weight, b, packed)

        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden]
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        self.lm_head = linear(head)
        self.norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=linear(
                        *(p + f"self_attn.{x}_proj" for x in "qkv"), bias=config.attention_bias
                    ),
                    o=linear(p + "self_attn.o_proj"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=linear(p + "mlp.gate_proj", p + "mlp.up_proj"),
                    down=linear(p + "mlp.down_proj"),
                )
            )
        self.rotary = Rotary(config, dtype, self.device)

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> KVCache:
        return KVCache(self.config, num_blocks, block_size, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] in float32; K/V of every row is cached."""
        plan = self.attention.plan(batch)
        cos, sin = self.rotary.tables(batch.positions)
        h = self.embed[batch.token_ids]  # [T, hidden]
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv.layer(i)
            h = h + self._attention(layer, h, cos, sin, k_cache, v_cache, plan)
            h = h + self._mlp(layer, h)
        h = rms_norm(h[batch.logits_rows], self.norm, self.config.rms_norm_eps)
        return self.lm_head(h).float()

    def _attention(
        self,
        layer: LayerWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: object,
    ) -> torch.Tensor:
        c = self.config
        x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
        q, k, v = layer.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        out = self.attention.forward(q, k, v, k_cache, v_cache, plan)  # [T, heads, D]
        return layer.o(out.reshape(-1, c.q_size))

    def _mlp(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, layer.post_norm, self.config.rms_norm_eps)
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)
