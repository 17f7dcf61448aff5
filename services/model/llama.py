"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Weights are packed for the CPU's sake at load time: q/k/v fused into one matrix, gate/up into
another, and every matrix stored pre-transposed ([in, out], contiguous), which makes the
skinny decode matmuls up to 2x faster than torch's default [out, in] layout here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model.attention import Attention, TorchAttention
from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache
from services.model.rope import Rotary, apply_rotary


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [hidden, q + 2 kv]
    qkv_bias: torch.Tensor | None  # [q + 2 kv]
    o: torch.Tensor  # [q, hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [hidden, 2 ff]
    down: torch.Tensor  # [ff, hidden]


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
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.attention: Attention = attention or TorchAttention()

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        def t(*names: str) -> torch.Tensor:
            # [out, in] matrices -> one [in, sum(out)] matrix
            return torch.cat([w(n) for n in names], dim=0).t().contiguous()

        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden]
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = t(head)  # [hidden, vocab]
        self.norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj" for x in ("q", "k", "v")]
            bias = torch.cat([w(n + ".bias") for n in attn]) if config.attention_bias else None
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=t(*(n + ".weight" for n in attn)),
                    qkv_bias=bias,
                    o=t(p + "self_attn.o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=t(p + "mlp.down_proj.weight"),
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
        return (h @ self.lm_head).float()

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
        qkv = x @ layer.qkv if layer.qkv_bias is None else torch.addmm(layer.qkv_bias, x, layer.qkv)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        out = self.attention.forward(q, k, v, k_cache, v_cache, plan)  # [T, heads, D]
        return out.reshape(-1, c.q_size) @ layer.o

    def _mlp(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, layer.post_norm, self.config.rms_norm_eps)
        gate, up = (x @ layer.gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ layer.down
