"""The shape of a decoder, read from a GGUF's metadata or a config.json by its family
(services/model/families/): what every decoder has, the experts of those that have them (the
shared MoE layer's shape), what the family adds (`shape`, read by the family's code alone) and
the groups its cache is made of (cache_spec.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.model.cache_spec import CacheSpec
from services.model.vision.shape import VisionShape


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

    architecture: str  # the model_type it was read as (a family's: families/__init__.py)
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
    # a window every layer attends within (Mistral's): the context is capped to it so that
    # attention stays exact
    sliding_window: int | None = None
    qk_norm: bool = False  # q and k RMS-normed per head before rotary (Qwen3)
    moe: MoeShape | None = None  # the experts, where some layers' MLP is a mixture
    # what the family adds to a decoder's shape (its own frozen dataclass), read only by the
    # family's code
    shape: object = None
    # the cache's groups (None: per-head K and V of every layer, kept for good)
    cache: CacheSpec | None = None
    # DeepSeek's FP8 checkpoints: e4m3 weights with a float32 scale per block of this shape
    # (weight_scale_inv): dequantized at load, or kept FP8 on the Triton path (kernels/gpu/fp8.py)
    fp8_block: tuple[int, int] | None = None
    # a model that reads images: its placeholders, preprocessing and vision tower (None: text)
    vision: VisionShape | None = None
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
    def cache_spec(self) -> CacheSpec:
        if self.cache is not None:
            return self.cache
        return CacheSpec.uniform(self.num_layers, self.num_kv_heads, self.head_dim, self.head_dim)

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """A token's cache row per cache layer: (heads, K elements, V elements)."""
        return self.cache_spec.cache_shape

    @property
    def cache_layers(self) -> int:
        """Layers of the paged cache (a family may keep all its layers' rows as one)."""
        return self.cache_spec.layers

    @property
    def cache_elements(self) -> int:
        """Cache elements per token and cache layer."""
        heads, k_dim, v_dim = self.cache_shape
        return heads * (k_dim + v_dim)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i in self.moe.layers

    @property
    def max_model_len(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings
