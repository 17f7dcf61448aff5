"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Weights are arranged once at load time: q/k/v fused into one matrix and gate/up into another,
so a layer runs four matrix multiplies, each in the device's fastest layout (`linear.py`).

Determinism: on CPUs with the C kernels and oneDNN (the default wherever they build), in
float32 and bfloat16, every row of a forward pass is computed as if it were alone: a token's
K/V and logits have the same bits whatever shares the batch, however the prompt was chunked,
whether its prefix was computed, found in the cache or imported (stored in the compute dtype,
the default), and whether it was decoded or recomputed in a chunk. So greedy and seeded
outputs repeat exactly: cold or warm, alone or batched, before or after a stream migrates
(tests/services/engine/test_determinism.py, tests/decode/test_determinism_e2e.py). With a
torch fallback (GPUs, no C compiler, no oneDNN, float16) a run repeats itself, but rows move
in the last bits with the batch, and greedy outputs can differ where two logits are close.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.block_hash import BLOCK_SIZE
from services.model.attention import Attention, default_attention, resolve_kernels
from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache
from services.model.layer_ops import LayerOps, default_layer_ops
from services.model.linear import (
    Linear,
    amx_linear_library,
    make_linear,
    packed_linear_available,
)
from services.model.rope import Rotary
from services.settings import DEFAULTS


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q + 2 kv
    o: Linear  # q -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 ff
    down: Linear  # ff -> hidden


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention: Attention | None = None,
        packed: bool | None = None,
        ops: LayerOps | None = None,
        kernels: str = DEFAULTS.model.kernels,
    ) -> None:
        """`packed`: prepacked weights (default: wherever they work, i.e. CPUs: on AMX tiles for
        bfloat16 where they run, else oneDNN's);
        `attention`, `ops`: the kernels (default: those `kernels` names, attention.KERNELS:
        auto is the fastest the device has)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels = resolve_kernels(kernels, self.device)
        self.quantization = DEFAULTS.model.quantization  # quantize.quantize_int8 sets "int8"
        group = config.num_heads // config.num_kv_heads
        self.attention: Attention = attention or (
            _triton_attention()
            if self.kernels == "triton"
            else default_attention(self.device, dtype, config.head_dim, group, kernels=self.kernels)
        )
        if packed is None:
            packed = packed_linear_available(self.device, dtype)
        self.packed = packed
        # bfloat16 products on AMX tiles where they run (linear.py): a choice per process, so
        # every product of a model and every row count take the same path
        amx = amx_linear_library() if packed and dtype == torch.bfloat16 else None
        self.amx = amx is not None

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        def linear(*names: str, bias: bool = False) -> Linear:
            # several [out, in] matrices stacked into one [sum(out), in]
            weight = torch.cat([w(n + ".weight") for n in names], dim=0)
            b = torch.cat([w(n + ".bias") for n in names]) if bias else None
            return make_linear(weight, b, packed, amx)

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
        rotary = Rotary(config, dtype, self.device)
        self.ops: LayerOps = ops or (
            _triton_layer_ops(config, rotary)
            if self.kernels == "triton"
            else default_layer_ops(config, rotary, self.device, dtype, self.kernels)
        )

    def new_kv_cache(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> KVCache:
        return KVCache(self.config, num_blocks, block_size, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] in float32; K/V of every row is cached.

        The residual stream h is updated in place; each add is fused with the norm after it.
        """
        c, ops = self.config, self.ops
        plan = self.attention.plan(batch)
        at = ops.positions(batch.positions)
        h = self.embed.index_select(0, batch.token_ids)  # [T, hidden]
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, c.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv.layer(i)
            attended = self._attention(layer, x, at, k_cache, v_cache, plan)
            x = ops.add_rms_norm(h, attended, layer.post_norm, c.rms_norm_eps)
            mlp = layer.down(ops.silu_mul(layer.gate_up(x)))
            last = i + 1 == len(self.layers)
            norm = self.norm if last else self.layers[i + 1].input_norm
            x = ops.add_rms_norm(h, mlp, norm, c.rms_norm_eps)
        return self.lm_head(x[batch.logits_rows]).float()

    def _attention(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        at: object,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: object,
    ) -> torch.Tensor:
        q, k, v = self.ops.rotary(layer.qkv(x), at)
        out = self.attention.forward(q, k, v, k_cache, v_cache, plan)  # [T, heads, D]
        return layer.o(out.reshape(-1, self.config.q_size))


def _triton_attention() -> Attention:
    from services.model.gpu.attention import TritonAttention  # imports triton: only if asked

    return TritonAttention()


def _triton_layer_ops(config: ModelConfig, rotary: Rotary) -> LayerOps:
    from services.model.gpu.layer_ops import TritonLayerOps

    return TritonLayerOps(config, rotary)
