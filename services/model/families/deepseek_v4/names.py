"""DeepSeek-V4's tensors: their names as its own checkpoints and transformers' save_pretrained
write them (less the "model." prefix: `canonical_name`), and their shapes."""

from __future__ import annotations

from services.model.config import ModelConfig
from services.model.families.deepseek_v4.config import CSA, SLIDING, v4_of


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """DeepSeek's tensor names (as its checkpoints and transformers' save_pretrained write
    them, less the "model." prefix: `canonical_name`) and shapes."""
    v4, moe = v4_of(c), c.moe
    assert moe is not None
    d, h, heads, n = c.head_dim, c.hidden_size, c.num_heads, v4.hc_mult
    mix = (2 + n) * n
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (c.vocab_size, h),
        "norm.weight": (h,),
        "hc_head_fn": (n, n * h),
        "hc_head_base": (n,),
        "hc_head_scale": (1,),
    }
    if not c.tie_word_embeddings:
        shapes["head.weight"] = (c.vocab_size, h)
    for i, kind in enumerate(v4.layer_types):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)}
        for hc in ("hc_attn_", "hc_ffn_"):
            shapes |= {p + hc + "fn": (mix, n * h), p + hc + "base": (mix,), p + hc + "scale": (3,)}
        a = p + "attn."
        shapes |= {
            a + "wq_a.weight": (v4.q_lora_rank, h),
            a + "q_norm.weight": (v4.q_lora_rank,),
            a + "wq_b.weight": (heads * d, v4.q_lora_rank),
            a + "wkv.weight": (d, h),
            a + "norm.weight": (d,),
            a + "wo_a.weight": (v4.o_groups * v4.o_lora_rank, heads * d // v4.o_groups),
            a + "wo_b.weight": (h, v4.o_groups * v4.o_lora_rank),
            a + "attn_sink": (heads,),
        }
        if kind != SLIDING:
            series = 2 if kind == CSA else 1
            shapes |= _compressor(a + "compressor.", h, d, series, v4.rate(i))
        if kind == CSA:
            idx = a + "indexer."
            shapes |= _compressor(idx + "compressor.", h, v4.index_dim, 2, v4.csa_rate)
            shapes[idx + "wq_b.weight"] = (v4.index_heads * v4.index_dim, v4.q_lora_rank)
            shapes[idx + "weights_proj.weight"] = (v4.index_heads, h)
        f = p + "ffn."
        shapes[f + "gate.weight"] = (moe.num_experts, h)
        if i in v4.hash_layers:
            shapes[f + "gate.tid2eid"] = (c.vocab_size, moe.top_k)
        else:
            shapes[f + "gate.bias"] = (moe.num_experts,)
        ff = moe.intermediate_size
        for e in [f"{f}experts.{j}." for j in range(moe.num_experts)] + [f + "shared_experts."]:
            pack = 2 if v4.fp4_experts and "shared" not in e else 1  # two FP4 values a byte
            shapes |= {e + "w1.weight": (ff, h // pack), e + "w3.weight": (ff, h // pack),
                       e + "w2.weight": (h, ff // pack)}  # fmt: skip
    return shapes


def _compressor(
    p: str, hidden: int, dim: int, series: int, rate: int
) -> dict[str, tuple[int, ...]]:
    return {
        p + "wkv.weight": (series * dim, hidden),
        p + "wgate.weight": (series * dim, hidden),
        p + "ape": (rate, series * dim),
        p + "norm.weight": (dim,),
    }


def canonical_scale(name: str) -> str:
    """transformers' `<name>.weight_scale_inv` is DeepSeek's `<name>.scale`."""
    return (
        name.removesuffix(".weight_scale_inv") + ".scale" if name.endswith("_scale_inv") else name
    )


_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def canonical_name(name: str) -> str:
    """A stored tensor's name as `expected_shapes` spells it: DeepSeek's own checkpoints
    ("layers.0.attn.wq_a.weight", "embed.weight") and transformers' save_pretrained ("model."
    before them, "model.embed_tokens.weight", "model.hc_head.hc_fn") both map onto it."""
    name = canonical_scale(name.removeprefix("model."))
    return _TOP_LEVEL.get(name, name)
