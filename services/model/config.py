"""The shape of a decoder, read from a GGUF's metadata or a config.json: Llama-family
attention (one K and V per KV head) or DeepSeek's multi-head latent attention (MLA), each layer's
MLP dense or a mixture of experts (MoE)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.model.gemma3_config import Gemma3Shape
from services.model.oss_config import OssShape
from services.model.shapes import embedding_shapes
from services.model.v4_config import V4Shape, row_widths, window_keep

ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3",
    "mixtral", "qwen2_moe", "qwen3_moe",
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "gpt_oss", "gemma3_text",
)  # fmt: skip


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3"); linear scaling as a factor;
    YaRN ("yarn": DeepSeek's long context, with its attention-scale corrections)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # with mscale_all_dim, sets the cos/sin factor (attention_factor)
    mscale_all_dim: float = 0.0  # MLA: also scales the softmax of every dimension
    attention_factor: float | None = None  # given outright, it wins over the mscales
    truncate: bool = True  # the correction range rounded to whole dimensions

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2/V3). A token's cache row, per layer, is its
    normalized KV latent (kv_lora_rank) and its rotary key (rope_dim), shared by every head;
    kv_b_proj expands the latent into each head's non-rotary key (nope_dim) and value (v_dim)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    nope_dim: int  # qk_nope_head_dim
    rope_dim: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim
    # "pairs": the rotary dimensions rotate in adjacent pairs (x0, x1), (x2, x3), as DeepSeek's
    # weights are laid out (V2; V3's rope_interleave); "half": rotate-half, as Llama
    rope_pairs: bool = True

    @property
    def latent_dim(self) -> int:
        """Elements of one token's cache row per layer: latent, then rotary key."""
        return self.kv_lora_rank + self.rope_dim


SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts MLP: a router picks `top_k` of `num_experts` SwiGLU experts per
    token and sums their outputs weighted; shared experts see every token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    layers: tuple[int, ...]  # the layers whose MLP is a MoE (the others are dense)
    scoring: str = "softmax"  # SCORING: router probabilities over the logits
    # TOPK_METHODS: greedy, top-k of all; group_limited_greedy (V2), top-k of the experts of
    # the topk_group groups with the best expert; noaux_tc (V3), groups ranked by their two best
    # scores plus e_score_correction_bias, which also steers the choice but not the weights
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False  # chosen weights renormalized to sum to 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # shared experts' MLP width (0: none)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert scaled by sigmoid(gate(x))
    float32_router: bool = False  # DeepSeek: router logits in float32 whatever the dtype
    prefix: str = "mlp"  # weight names: "mlp" (gate, experts.E.gate_proj...) or Mixtral's
    # "block_sparse_moe" (gate, experts.E.w1 / w3 / w2)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a checkpoint's layout."""

    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q, k and v projections (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    # Mistral's sliding window; the context is capped to it so attention stays exact.
    sliding_window: int | None = None
    qk_norm: bool = False  # Qwen3: q and k RMS-normed per head before rotary
    mla: MlaShape | None = None  # latent attention (head_dim is then nope_dim + rope_dim)
    moe: MoeShape | None = None
    v4: V4Shape | None = None  # DeepSeek-V4's windows, compressors and hyper-connections
    oss: OssShape | None = None  # gpt-oss's per-layer windows and experts' activation
    gemma3: Gemma3Shape | None = None  # Gemma 3's local and global layers
    # DeepSeek's FP8 checkpoints: e4m3 weights with a float32 scale per block of this shape
    # (weight_scale_inv): dequantized at load, or kept FP8 on the Triton path (gpu/fp8.py)
    fp8_block: tuple[int, int] | None = None
    name: str = field(default="model", compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """A token's cache row per layer: (heads, K dims, V dims). MLA's is one "head" of
        latent + rotary key, with no separate V (the latent is both). DeepSeek-V4's is one
        row of every layer's parts together (v4_config.row_layout), kept as one layer: its
        shares, then its window part (`window_width` elements, a pool of their own)."""
        if self.v4 is not None:
            return 1, sum(row_widths(self.v4, self.head_dim)), 0
        if self.mla is not None:
            return 1, self.mla.latent_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def window_width(self) -> int:
        """The last elements of cache_shape's K held in a pool of window blocks, released once
        no query reads them (KVCache, BlockManager); 0: the whole row is kept."""
        return row_widths(self.v4, self.head_dim)[1] if self.v4 is not None else 0

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each decoder layer's sliding window, None for a full one (gpt-oss, Gemma 3)."""
        shape = self.oss or self.gemma3
        return shape.windows if shape is not None else ()

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Cache layers held whole in window blocks: gpt-oss's and Gemma 3's sliding ones."""
        return tuple(i for i, window in enumerate(self.layer_windows) if window is not None)

    @property
    def window_keep(self) -> int:
        """Tokens before a pass's first new one whose window part the pass may read."""
        if self.v4 is not None:
            return window_keep(self.v4)
        return max((w - 1 for w in self.layer_windows if w is not None), default=0)

    @property
    def window_elements(self) -> int:
        """Cache elements a token keeps in window blocks (0: none)."""
        return self.window_width or len(self.window_layers) * self.cache_elements

    @property
    def cache_elements(self) -> int:
        """Cache elements per token and layer."""
        heads, k_dim, v_dim = self.cache_shape
        return heads * (k_dim + v_dim)

    @property
    def cache_layers(self) -> int:
        """Layers of the paged cache: one per decoder layer, or one for DeepSeek-V4's row."""
        return 1 if self.v4 is not None else self.num_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i in self.moe.layers

    @property
    def max_model_len(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.expected_shapes().values())

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor names and the shape each must have."""
        if self.v4 is not None:
            from services.model.v4_config import expected_shapes

            return expected_shapes(self)
        if self.oss is not None:
            from services.model import oss_config

            return oss_config.expected_shapes(self)
        if self.gemma3 is not None:
            from services.model import gemma3_config

            return gemma3_config.expected_shapes(self)
        h = self.hidden_size
        shapes = embedding_shapes(self.vocab_size, h, self.tie_word_embeddings)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes |= self._attention_shapes(p + "self_attn.")
            if self.is_moe_layer(i):
                shapes |= self._moe_shapes(p)
            else:
                shapes |= _mlp_shapes(p + "mlp.", h, self.intermediate_size)
        return shapes

    def _attention_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        h, kv, q = self.hidden_size, self.kv_size, self.q_size
        if self.mla is not None:
            return _mla_shapes(p, h, self.num_heads, self.mla, self.attention_bias)
        shapes: dict[str, tuple[int, ...]] = {
            p + "q_proj.weight": (q, h),
            p + "k_proj.weight": (kv, h),
            p + "v_proj.weight": (kv, h),
            p + "o_proj.weight": (h, q),
        }
        if self.attention_bias:
            shapes |= {p + "q_proj.bias": (q,), p + "k_proj.bias": (kv,), p + "v_proj.bias": (kv,)}
        if self.qk_norm:
            shapes |= {p + "q_norm.weight": (self.head_dim,), p + "k_norm.weight": (self.head_dim,)}
        return shapes

    def _moe_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        moe, h = self.moe, self.hidden_size
        assert moe is not None
        p += moe.prefix + "."
        shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (moe.num_experts, h)}
        if moe.topk_method == "noaux_tc":
            shapes[p + "gate.e_score_correction_bias"] = (moe.num_experts,)
        for e in range(moe.num_experts):
            names = ("w1", "w3", "w2") if moe.prefix == "block_sparse_moe" else None
            shapes |= _mlp_shapes(f"{p}experts.{e}.", h, moe.intermediate_size, names)
        if moe.shared_intermediate_size:
            shared = "shared_expert." if moe.shared_gate else "shared_experts."
            shapes |= _mlp_shapes(p + shared, h, moe.shared_intermediate_size)
        if moe.shared_gate:
            shapes[p + "shared_expert_gate.weight"] = (1, h)
        return shapes

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers (and vLLM) load as this architecture (the GGUF
        families: llama, mistral, qwen2)."""
        arch_class = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
        }
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if isinstance(eos, list) and len(eos) == 1:
            eos = eos[0]
        out: dict[str, Any] = {
            "architectures": [arch_class[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        if self.architecture == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if self.architecture == "mistral":
            out["sliding_window"] = self.sliding_window
        return out


def _mlp_shapes(
    p: str, hidden: int, ff: int, names: tuple[str, str, str] | None = None
) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's gate, up and down projections (Mixtral's experts call them w1, w3, w2)."""
    gate, up, down = names or ("gate_proj", "up_proj", "down_proj")
    return {
        f"{p}{gate}.weight": (ff, hidden),
        f"{p}{up}.weight": (ff, hidden),
        f"{p}{down}.weight": (hidden, ff),
    }


def _mla_shapes(
    p: str, hidden: int, heads: int, mla: MlaShape, bias: bool
) -> dict[str, tuple[int, ...]]:
    qk = mla.nope_dim + mla.rope_dim
    shapes: dict[str, tuple[int, ...]] = {
        p + "kv_a_proj_with_mqa.weight": (mla.latent_dim, hidden),
        p + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        p + "kv_b_proj.weight": (heads * (mla.nope_dim + mla.v_dim), mla.kv_lora_rank),
        p + "o_proj.weight": (hidden, heads * mla.v_dim),
    }
    if mla.q_lora_rank is None:
        shapes[p + "q_proj.weight"] = (heads * qk, hidden)
    else:
        shapes |= {
            p + "q_a_proj.weight": (mla.q_lora_rank, hidden),
            p + "q_a_layernorm.weight": (mla.q_lora_rank,),
            p + "q_b_proj.weight": (heads * qk, mla.q_lora_rank),
        }
    if bias:
        shapes[p + "kv_a_proj_with_mqa.bias"] = (mla.latent_dim,)
        shapes[p + "o_proj.bias"] = (hidden,)
        if mla.q_lora_rank is not None:
            shapes[p + "q_a_proj.bias"] = (mla.q_lora_rank,)
    return shapes
