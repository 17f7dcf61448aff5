"""The shape of a Llama-family decoder, read from a GGUF's metadata or a config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3"); linear scaling as a factor."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out


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
    def max_model_len(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
        )
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        embeddings = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embeddings
        return self.num_layers * per_layer + embeddings + head + self.hidden_size

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor names and the shape each must have."""
        h, kv, q, ff = self.hidden_size, self.kv_size, self.q_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (ff, h),
                p + "mlp.up_proj.weight": (ff, h),
                p + "mlp.down_proj.weight": (h, ff),
            }
            if self.attention_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
        return shapes

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers (and vLLM) load as this architecture."""
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
