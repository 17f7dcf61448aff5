"""The decoder over a paged KV cache: Llama-family attention (Llama, Mistral, Qwen2/3, and the
mixtures built on them: Mixtral, Qwen-MoE), each layer's MLP dense or a mixture of experts
(layers/moe.py). DeepSeek-V2/V3 (families/deepseek/model.py) change its attention only.

Weights are arranged once at load time: q/k/v fused into one matrix and gate/up into another,
so a dense layer runs four matrix multiplies, each in the device's fastest layout (`linear.py`).

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvstore.block_hash import BLOCK_SIZE
from services.model import kv_cache
from services.model.batch import ForwardBatch, SeqChunk
from services.model.blend import BlendChoice, rows_batch
from services.model.causal_lm import Capabilities
from services.model.config import ModelConfig
from services.model.families.llama import gpu
from services.model.kv_cache import KVCache
from services.model.layers.attention import Attention, default_attention, resolve_kernels
from services.model.layers.layer_ops import LayerOps, default_layer_ops, rms_norm
from services.model.layers.linear import (
    Linear,
    amx_linear_library,
    make_linear,
    make_logits_linear,
    packed_linear_available,
)
from services.model.layers.moe import DenseMlp, Moe, built_experts
from services.model.layers.rope import Rotary, inverse_frequencies
from services.model.loading import hf_dir
from services.settings import DEFAULTS


@dataclass(frozen=True)
class GqaWeights:
    """Llama-family attention: one K and V per KV head."""

    qkv: Linear  # hidden -> q + 2 kv
    o: Linear  # q -> hidden
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    attention: GqaWeights | Any  # a family's own (DeepSeek's MlaWeights)
    post_norm: torch.Tensor  # [hidden]
    mlp: DenseMlp | Moe


class DecoderModel:
    # --quantization int8's products (loading/quantize.py): path in LayerWeights, checkpoint names
    int8_products: ClassVar[dict[tuple[str, ...], tuple[str, ...]]] = {
        ("attention", "qkv"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("attention", "o"): ("self_attn.o_proj",),
        ("mlp", "gate_up"): ("mlp.gate_proj", "mlp.up_proj"),
    }

    @classmethod
    def supports(cls, config: ModelConfig) -> Capabilities:
        """CUDA graphs where no layer routes rows to experts (their grouped products take a
        batch's shape), int8 weights for dense models; approximate KV reuse where every layer
        attends to the whole context (a sliding window's keys are not all in the cache)."""
        return Capabilities(
            cuda_graphs=config.moe is None or not config.moe.layers,
            int8=config.moe is None,
            hidden_rows=True,
            approximate_reuse=config.sliding_window is None and config.vision is None,
        )

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
        deterministic: bool = DEFAULTS.model.deterministic,
    ) -> None:
        """`deterministic`: row-invariant products on a GPU (linear.make_linear); `packed`:
        prepacked weights (default: wherever they work, i.e. CPUs: on AMX tiles for
        bfloat16 where they run, else oneDNN's);
        `attention`, `ops`: the kernels (default: those `kernels` names, attention.KERNELS:
        auto is the fastest the device has)."""
        self.config = config
        self.capabilities = self.supports(config)
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels = resolve_kernels(kernels, self.device)
        self.quantization = DEFAULTS.model.quantization  # quantize.quantize_int8 sets "int8"
        group = config.num_heads // config.num_kv_heads
        self.attention: Attention = attention or (
            gpu.triton_attention()
            if self.kernels == "triton"
            else default_attention(self.device, dtype, config.head_dim, group, kernels=self.kernels)
        )
        if packed is None:
            packed = packed_linear_available(self.device, dtype)
        self.packed = packed
        self.deterministic = deterministic
        # bfloat16 products on AMX tiles where they run (linear.py): a choice per process, so
        # every product of a model and every row count take the same path
        amx = amx_linear_library() if packed and dtype == torch.bfloat16 else None
        self.amx = amx is not None
        self.keep_hidden = False  # keep the last forward's normed rows in `hidden` (MTP)
        self.hidden: torch.Tensor | None = None

        fp8 = config.fp8_block

        def w(name: str, keep_float32: bool = False) -> torch.Tensor:
            # keep_float32: a router's weights, kept at least as precise as float32
            want = torch.promote_types(dtype, torch.float32) if keep_float32 else dtype
            t = weights[name]
            if t.dtype == torch.float8_e4m3fn and fp8 is not None:
                t = hf_dir.dequantize(t, weights[name + hf_dir.SCALE], fp8)
            return t.to(device=self.device, dtype=want)

        def linear(
            *names: str,
            bias: bool = False,
            missing_bias_ok: bool = False,
            keep_float32: bool = False,
        ) -> Linear:
            # several [out, in] matrices stacked into one [sum(out), in]; a matrix without a
            # bias of its own (where `missing_bias_ok`) adds zeros
            if fp8 is not None and self.kernels == "triton" and not (keep_float32 or bias):
                kept = gpu.fp8_linear(weights, names, fp8, self.device)
                if kept is not None:
                    return kept
            weight = torch.cat([w(n + ".weight", keep_float32) for n in names], dim=0)
            b = None
            if bias:
                b = torch.cat(
                    [
                        w(n + ".bias")
                        if n + ".bias" in weights or not missing_bias_ok
                        else weight.new_zeros(w(n + ".weight").shape[0])
                        for n in names
                    ]
                )
            return make_linear(weight, b, packed, amx, self.deterministic)

        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden]
        # ids -> rows [T, hidden]; tensor ranks hold a slice of the vocabulary (parallel/)
        self.lookup: Callable[[torch.Tensor], torch.Tensor] = self._lookup
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        fp8_head = (  # an FP8 head stays FP8 for the Triton kernel (gpu/fp8.py)
            gpu.fp8_linear(weights, (head,), fp8, self.device)
            if fp8 is not None and self.kernels == "triton"
            else None
        )  # else float32 logits, from bfloat16 weights where the device can
        self.lm_head = (
            fp8_head
            if fp8_head is not None
            else make_logits_linear(w(head + ".weight"), packed, amx, self.deterministic)
        )
        self.norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    attention=self._attention_weights(p + "self_attn.", w, linear),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    mlp=self._moe(p, w, linear, weights)
                    if config.is_moe_layer(i)
                    else _mlp(p + "mlp.", linear),
                )
            )
        rotary = Rotary(config, dtype, self.device)
        self.ops: LayerOps = ops or (
            gpu.triton_layer_ops(config, rotary)
            if self.kernels == "triton"
            else default_layer_ops(config, rotary, self.device, dtype, self.kernels)
        )

    def _attention_weights(self, p: str, w: WeightFn, linear: LinearFn) -> Any:
        c = self.config
        return GqaWeights(
            qkv=linear(*(p + f"{x}_proj" for x in "qkv"), bias=c.attention_bias),
            o=linear(p + "o_proj"),
            q_norm=w(p + "q_norm.weight") if c.qk_norm else None,
            k_norm=w(p + "k_norm.weight") if c.qk_norm else None,
        )

    def _moe(
        self, p: str, w: WeightFn, linear: LinearFn, weights: Mapping[str, torch.Tensor]
    ) -> Moe:
        moe = self.config.moe
        assert moe is not None
        p += moe.prefix + "."
        w1w3w2 = moe.prefix == "block_sparse_moe"  # the experts' products named w1, w3, w2

        def expert(j: int) -> DenseMlp:
            e = f"{p}experts.{j}."
            if w1w3w2:
                return DenseMlp(linear(e + "w1", e + "w3"), linear(e + "w2"))
            return _mlp(e, linear)

        shared = None
        if moe.shared_intermediate_size:
            shared = _mlp(p + ("shared_expert." if moe.shared_gate else "shared_experts."), linear)
        return Moe(
            moe,
            gate=linear(p + "gate", keep_float32=moe.float32_router),
            router_dtype=torch.promote_types(self.dtype, torch.float32)
            if moe.float32_router
            else self.dtype,
            correction_bias=(
                w(p + "gate.e_score_correction_bias", keep_float32=True)
                if moe.topk_method == "noaux_tc"
                else None
            ),
            experts=built_experts(moe.num_experts, expert, weights),
            shared=shared,
            shared_gate=linear(p + "shared_expert_gate") if moe.shared_gate else None,
            build=expert,
        )

    def moe_layers(self) -> dict[int, Moe]:
        return {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, Moe)}

    def expert_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start, by MoE layer (empty for dense models)."""
        return {i: moe.counts.tolist() for i, moe in self.moe_layers().items()}

    def new_kv_cache(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        group_blocks: Mapping[str, int] | None = None,
    ) -> KVCache:
        return KVCache(self.config, num_blocks, block_size, self.dtype, self.device, group_blocks)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVCache, embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] in float32; K/V of every row is cached;
        with `keep_hidden`, every row's final normed hidden state [T, hidden] kept in
        `self.hidden` (what MTP drafts from). `embeds`: the rows' inputs in place of the
        embeddings [T, hidden].

        The residual stream h is float32 whatever the compute dtype (each layer's products and
        attention compute in it): its sums then lose nothing in bfloat16, which kept the
        answers closer to float32's than transformers' own bfloat16 (bench/dtype_quality.py).
        h is updated in place; each add is fused with the norm after it.
        """
        c, ops = self.config, self.ops
        plan, at = self._plan(batch)
        rows = self.lookup(batch.token_ids) if embeds is None else embeds
        h = rows.to(torch.float32, copy=True)  # [T, hidden]
        if batch.embeds is not None:  # images' rows in their placeholders' place
            h[batch.embed_rows] = batch.embeds.to(rows.dtype).float()
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, c.rms_norm_eps)
        for i in range(len(self.layers)):
            x = self._layer(i, h, x, at, kv, plan)
        self.hidden = x if self.keep_hidden else None
        return self.lm_head(x[batch.logits_rows]).float()

    def _layer(
        self, i: int, h: torch.Tensor, x: torch.Tensor, at: object, kv: KVCache, plan: object
    ) -> torch.Tensor:
        """Layer i over the residual stream h (updated in place) and its normed rows x: the
        next layer's normed input (the final norm's after the last)."""
        c, ops, layer = self.config, self.ops, self.layers[i]
        attended = self._attention(i, layer.attention, x, at, kv, plan)
        x = ops.add_rms_norm(h, attended, layer.post_norm, c.rms_norm_eps)
        mlp = layer.mlp(x, ops)
        last = i + 1 == len(self.layers)
        norm = self.norm if last else self.layers[i + 1].input_norm
        return ops.add_rms_norm(h, mlp, norm, c.rms_norm_eps)

    @torch.inference_mode()
    def blend(
        self, chunk: SeqChunk, kv: KVCache, choose: BlendChoice, check: int = 1
    ) -> tuple[list[int], torch.Tensor]:
        """Compute `chunk` (prompt tokens whose slots may hold K/V placed from elsewhere) as
        services/model/blend.py says: every row below layer `check`; there, `choose` picks from
        the rows' new values and their slots' the rows computed from then on, the others keep
        their slots' K/V. The rows chosen (offsets into the chunk), and the logits of the
        chunk's last row where it wants them ([1, vocab] float32; else [0, vocab])."""
        c, ops = self.config, self.ops
        batch = ForwardBatch.build([chunk], kv.block_size, self.device)
        plan, at = self._plan(batch)
        h = self.lookup(batch.token_ids).to(torch.float32, copy=True)  # [T, hidden]
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, c.rms_norm_eps)
        rows = list(range(len(chunk.token_ids)))
        for i in range(len(self.layers)):
            if i == check:
                placed = self.cached_rows(i, kv, batch.slot_mapping)
                rows = choose(self.blend_rows(i, x, at), placed)
                keep = torch.tensor(rows, dtype=torch.int64, device=self.device)
                h, x = h.index_select(0, keep), x.index_select(0, keep)
                batch = rows_batch(chunk, rows, kv.block_size, self.device)
                plan, at = self._plan(batch)
            x = self._layer(i, h, x, at, kv, plan)
        return rows, self.lm_head(x[batch.logits_rows]).float()

    def blend_rows(self, i: int, x: torch.Tensor, at: object) -> torch.Tensor:
        """What `blend` measures a row's deviation on at layer i: its values [T, kv, D]."""
        c = self.config
        v = self.layers[i].attention.qkv(x)[:, c.q_size + c.kv_size :]
        return v.reshape(-1, c.num_kv_heads, c.head_dim)

    def cached_rows(self, i: int, kv: KVCache, slots: torch.Tensor) -> torch.Tensor:
        """The same as the cache holds it at `slots` of layer i."""
        return kv_cache.read(*kv.layer(i), slots)[1]

    def key_rotation(self) -> tuple[int, torch.Tensor]:
        """Where a cached key's rotary part starts, and its inverse frequencies (rotate-half
        form): every dimension of a head here."""
        c = self.config
        return 0, inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed.index_select(0, ids)

    def _plan(self, batch: ForwardBatch) -> tuple[object, object]:
        """What every layer's attention reads of the batch: its kernel's plan, and the rotary
        tables (or positions) of its rows."""
        return self.attention.plan(batch), self.ops.positions(batch.positions)

    def _attention(
        self, i: int, layer: Any, x: torch.Tensor, at: object, kv: KVCache, plan: object
    ) -> torch.Tensor:
        """Layer i's attention over its rows x [T, hidden], its cache in `kv` ([T, hidden])."""
        k_cache, v_cache = kv.layer(i)
        qkv = layer.qkv(x)
        if layer.q_norm is not None:
            qkv = self._qk_norm(qkv, layer)
        q, k, v = self.ops.rotary(qkv, at)
        out = self.attention.forward(q, k, v, k_cache, v_cache, plan)  # [T, heads, D]
        return layer.o(out.reshape(-1, self.config.q_size))

    def _qk_norm(self, qkv: torch.Tensor, layer: GqaWeights) -> torch.Tensor:
        """Qwen3: each head's q and k RMS-normed (before rotary)."""
        c = self.config
        assert layer.q_norm is not None and layer.k_norm is not None
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = rms_norm(q.reshape(-1, c.num_heads, c.head_dim), layer.q_norm, c.rms_norm_eps)
        k = rms_norm(k.reshape(-1, c.num_kv_heads, c.head_dim), layer.k_norm, c.rms_norm_eps)
        return torch.cat((q.flatten(1), k.flatten(1), v), dim=-1)


WeightFn = Callable[..., torch.Tensor]
LinearFn = Callable[..., Linear]


def _mlp(p: str, linear: LinearFn) -> DenseMlp:
    return DenseMlp(linear(p + "gate_proj", p + "up_proj"), linear(p + "down_proj"))
