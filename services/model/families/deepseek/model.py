"""DeepSeek-V2/V3 over the paged cache: the shared decoder (families/llama/model.py) with
multi-head latent attention (mla.py) in place of grouped-query attention: a layer's weights
are MLA's, its cache rows latents, its rotary tables MLA's own over the rope dimensions."""

from __future__ import annotations

from typing import Any

import torch

from services.model import kv_cache
from services.model.batch import ForwardBatch
from services.model.causal_lm import Capabilities
from services.model.config import ModelConfig
from services.model.families.deepseek.config import mla_of
from services.model.families.deepseek.mla import (
    MlaAttention,
    MlaWeights,
    default_mla_attention,
    split_kv_b,
)
from services.model.families.llama.model import DecoderModel, LinearFn, WeightFn
from services.model.kv_cache import KVCache
from services.model.layers.layer_ops import LayerOps
from services.model.layers.rope import Rotary, inverse_frequencies


class DeepseekModel(DecoderModel):
    @classmethod
    def supports(cls, config: ModelConfig) -> Capabilities:
        """No CUDA graphs (latent attention's plan and its KV write take no padded rows) and
        no int8 weights; approximate KV reuse (the rope part of a latent row turns)."""
        return Capabilities(hidden_rows=True, approximate_reuse=True)

    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.mla: MlaAttention = (
            _triton_mla(config, self.ops)
            if self.kernels == "triton"
            else default_mla_attention(config, self.ops, self.device, self.dtype, self.kernels)
        )
        # MLA rotates its rope_dim only, with tables of its own
        self.mla_rotary = Rotary(config, self.dtype, self.device, mla_of(config).rope_dim)

    def _attention_weights(self, p: str, w: WeightFn, linear: LinearFn) -> MlaWeights:
        c, m = self.config, mla_of(self.config)
        bias = c.attention_bias
        k_up, v_up = split_kv_b(w(p + "kv_b_proj.weight"), c.num_heads, m)
        lora = m.q_lora_rank is not None
        return MlaWeights(
            qkv_a=linear(
                p + ("q_a_proj" if lora else "q_proj"),
                p + "kv_a_proj_with_mqa",
                bias=bias,
                missing_bias_ok=not lora,
            ),
            q_a_norm=w(p + "q_a_layernorm.weight") if lora else None,
            q_b=linear(p + "q_b_proj") if lora else None,
            kv_a_norm=w(p + "kv_a_layernorm.weight"),
            kv_b=linear(p + "kv_b_proj"),
            k_up=k_up,
            v_up=v_up,
            o=linear(p + "o_proj", bias=bias),
        )

    def blend_rows(self, i: int, x: torch.Tensor, at: object) -> torch.Tensor:
        """A row's normed latent at layer i (what its every head's key and value are made of;
        the rotary key aside): [T, 1, kv_lora_rank]."""
        layer = self.layers[i].attention
        assert isinstance(at, tuple) and isinstance(layer, MlaWeights)
        latent = self.mla.project(layer, x, at)[2]
        return latent[:, None, : mla_of(self.config).kv_lora_rank]

    def cached_rows(self, i: int, kv: KVCache, slots: torch.Tensor) -> torch.Tensor:
        return kv_cache.read(*kv.layer(i), slots)[0][..., : mla_of(self.config).kv_lora_rank]

    def key_rotation(self) -> tuple[int, torch.Tensor]:
        """Only the rope part of a latent row turns (the latent has no position); stored
        de-interleaved ([evens | odds], apply_rotary_pairs) or as rotate-half alike, a turn
        is rotate-half on it."""
        c, m = self.config, mla_of(self.config)
        return m.kv_lora_rank, inverse_frequencies(m.rope_dim, c.rope_theta, c.rope_scaling)

    def _plan(self, batch: ForwardBatch) -> tuple[object, object]:
        return self.mla.plan(batch), self.mla_rotary.tables(batch.positions)

    def _attention(
        self, i: int, layer: Any, x: torch.Tensor, at: object, kv: KVCache, plan: object
    ) -> torch.Tensor:
        assert isinstance(at, tuple)
        k_cache, v_cache = kv.layer(i)
        return self.mla.forward(layer, x, at, k_cache, v_cache, plan)


def _triton_mla(config: ModelConfig, ops: LayerOps) -> MlaAttention:
    from services.model.families.deepseek.triton_mla import TritonMlaAttention

    return TritonMlaAttention(config, ops)
