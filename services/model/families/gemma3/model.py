"""Gemma 3's text decoder (`Gemma3ForCausalLM`) over the usual per-head pool: local layers
attend over a sliding window, global layers over everything (row_attention.attend_row, one
query row at a time), each kind rotated with its own rope base."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from services.model import kv_cache
from services.model.batch import ForwardBatch
from services.model.causal_lm import Capabilities
from services.model.config import ModelConfig
from services.model.families.base import PagedModel
from services.model.families.gemma3.config import gemma3_of
from services.model.kv_cache import KVCache
from services.model.layers import pointwise
from services.model.layers.linear import Linear
from services.model.layers.rope import apply_rotary, attention_factor, inverse_frequencies
from services.model.layers.row_attention import attend_paged


@dataclass(frozen=True)
class Gemma3Layer:
    norms: dict[str, torch.Tensor]  # input, post_attention, pre_feedforward, post_feedforward
    qkv: Linear
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    window: int | None
    gate_up: Linear
    down: Linear


class Gemma3Model(PagedModel):
    # --quantization int8's products (loading/quantize.py): path in Gemma3Layer, checkpoint names
    int8_products: ClassVar[dict[tuple[str, ...], tuple[str, ...]]] = {
        ("qkv",): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("o",): ("self_attn.o_proj",),
        ("gate_up",): ("mlp.gate_proj", "mlp.up_proj"),
    }

    @classmethod
    def supports(cls, config: ModelConfig) -> Capabilities:
        """int8 weights (its products are Linears, calibrated as Llama's); no CUDA graphs (its
        row attention takes key lists built on the host: docs/design.md)."""
        return Capabilities(int8=True)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        config, dtype = self.config, self.dtype
        g = gemma3_of(config)
        self.gemma = g

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device, dtype)

        def linear(*names: str, bias: bool = False) -> Linear:
            stacked = torch.cat([w(n + ".weight") for n in names])
            biases = torch.cat([w(n + ".bias") for n in names]) if bias else None
            return self.product(stacked, biases)

        scale = torch.tensor(config.hidden_size**0.5).to(dtype)  # in the weights' dtype
        self.embed = w("model.embed_tokens.weight")
        self.embed_scale = scale.to(self.device)
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        self.lm_head = self.logits_product(w(head + ".weight"))
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            norms = ("input", "post_attention", "pre_feedforward", "post_feedforward")
            self.layers.append(
                Gemma3Layer(
                    norms={n: w(f"{p}{n}_layernorm.weight") for n in norms},
                    qkv=linear(
                        a + "q_proj", a + "k_proj", a + "v_proj", bias=config.attention_bias
                    ),
                    o=linear(a + "o_proj", bias=config.attention_bias),
                    q_norm=w(a + "q_norm.weight"),
                    k_norm=w(a + "k_norm.weight"),
                    window=g.windows[i],
                    gate_up=linear(m + "gate_proj", m + "up_proj"),
                    down=linear(m + "down_proj"),
                )
            )
        local = dataclasses.replace(config, rope_theta=g.local_theta, rope_scaling=None)
        self._rope = {
            "local": _RopeSet(local, self.device),
            "global": _RopeSet(config, self.device),
        }

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        c = self.config
        tables = {k: r.tables(batch.positions, self.dtype) for k, r in self._rope.items()}
        h = self.embed.index_select(0, batch.token_ids) * self.embed_scale
        if batch.embeds is not None:  # an image's rows, not scaled
            h[batch.embed_rows] = batch.embeds.to(h.dtype)
        for i, layer in enumerate(self.layers):
            x = _norm(h, layer.norms["input"], c.rms_norm_eps)
            q, k, v = layer.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = _norm(q.reshape(-1, c.num_heads, c.head_dim), layer.q_norm, c.rms_norm_eps)
            k = _norm(k.reshape(-1, c.num_kv_heads, c.head_dim), layer.k_norm, c.rms_norm_eps)
            cos, sin = tables["local" if layer.window else "global"]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            group = kv.group_of(i)
            k_cache, v_cache = group.layer(i)
            kv_cache.write(k_cache, v_cache, batch.slots(group.index), k, v.reshape(k.shape))
            scale = self.gemma.query_scale
            out = attend_paged(q, k_cache, v_cache, batch, scale, layer.window, None, group.index)
            out = layer.o(out.flatten(1))
            h = h + _norm(out, layer.norms["post_attention"], c.rms_norm_eps)
            x = _norm(h, layer.norms["pre_feedforward"], c.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            out = layer.down(pointwise.gelu_tanh(gate) * up)
            h = h + _norm(out, layer.norms["post_feedforward"], c.rms_norm_eps)
        logits = self.lm_head(_norm(h[batch.logits_rows], self.norm, c.rms_norm_eps)).float()
        cap = self.gemma.final_softcap
        return logits if cap is None else pointwise.tanh(logits / cap) * cap


class _RopeSet:
    """cos, sin [T, 1, head_dim] (rotate-half) for positions, computed per pass (pointwise.py:
    an element's bits depend on its position alone), scaled as the config's rope says."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        dim = config.head_dim
        self.inv_freq = inverse_frequencies(dim, config.rope_theta, config.rope_scaling).to(device)
        self.factor = attention_factor(config.rope_scaling)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = pointwise.cos(emb) * self.factor, pointwise.sin(emb) * self.factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMS norm: float32, times (1 + weight), back in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)
