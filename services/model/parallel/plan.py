"""Which rows of which tensors a tensor-parallel rank holds, from the config alone (no
torch: the settings check reads it before anything loads). tensor.py splits by it."""

from __future__ import annotations

from typing import Any

from services.model.config import ModelConfig
from services.model.families.deepseek.config import MlaShape

SWIGLU_COLUMNS = 32  # the grouped kernel's SiLU takes 32 columns at a time


def check(config: ModelConfig, size: int) -> None:
    """ValueError, naming each size that does not divide, where the model does not split into
    `size` exact parts."""
    from services.model import families

    c, family = config, families.of(config)
    own = family.tensor_module()
    problems = []
    if own is not None:
        sizes = own.sizes(c)
    else:
        sizes = default_sizes(c)
        if not family.model.endswith((":DecoderModel", ":DeepseekModel")):
            problems.append(
                f"{c.architecture}: tensor parallelism covers the Llama family's decoder "
                "(Llama, Mistral, Qwen2/3, Qwen MoE, Mixtral), DeepSeek-V2, V3, V3.2 and V4"
            )
    if c.vision is not None:
        problems.append("a model that reads images runs on one rank (its image rows stay there)")
    problems[:0] = [
        f"{name} ({n}) is not a multiple of {size * unit}"
        for name, n, unit in sizes
        if n % (size * unit)
    ]
    if problems:
        raise ValueError("--tensor-parallel " + str(size) + ": " + "; ".join(problems))


def default_sizes(c: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, size, unit) of the Llama family's and DeepSeek-V2/V3's split: each size must be
    a multiple of the rank count times its unit."""
    sizes = [
        ("num_kv_heads", c.num_kv_heads, 1),
        ("hidden_size", c.hidden_size, 16),
        ("vocab_size", c.vocab_size, 16),
    ]
    if any(not c.is_moe_layer(i) for i in range(c.num_layers)):
        sizes.append(("intermediate_size", c.intermediate_size, SWIGLU_COLUMNS))
    if c.moe is not None and c.moe.layers:
        sizes.append(("num_experts", c.moe.num_experts, 1))
    return sizes


def cache_whole(config: ModelConfig) -> bool:
    """Whether every rank's pool holds every block whole (one latent, or one K=V head, for
    every query head) rather than its own heads' part."""
    from services.model import families

    own = families.of(config).tensor_module()
    return own.cache_whole if own is not None else isinstance(config.shape, MlaShape)


def slices(config: ModelConfig, rank: int, size: int) -> dict[str, slice]:
    """The rows of each split tensor this rank holds (its heads' rows of the attention's
    products, its columns of o, of the MLP's gate/up and down, its vocabulary rows of the
    head); tensors not named are whole on every rank."""
    from services.model import families

    check(config, size)
    c = config

    def part(total: int) -> slice:
        step = total // size  # rows of this rank's slice, of `total` along dim 0
        return slice(rank * step, (rank + 1) * step)

    own = families.of(c).tensor_module()
    if own is not None:
        return dict(own.rows(c, part))
    return default_rows(c, part)


def default_rows(c: ModelConfig, part: Any) -> dict[str, slice]:
    """`slices` for the Llama family and DeepSeek-V2/V3 (`part(total)`: this rank's share of
    `total` rows)."""
    out = {"lm_head.weight": part(c.vocab_size), "model.embed_tokens.weight": part(c.vocab_size)}
    heads_of = _mla_heads(c) if isinstance(c.shape, MlaShape) else _gqa_heads(c)
    for i in range(c.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out |= {name: part(total) for name, total in heads_of(a)}
        out[a + "o_proj.weight"] = part(c.hidden_size)
        if c.is_moe_layer(i):
            continue  # the experts whole here: parallelize keeps this rank's share
        out |= {m + x + ".weight": part(c.intermediate_size) for x in ("gate_proj", "up_proj")}
        out[m + "down_proj.weight"] = part(c.hidden_size)
    return out


def _gqa_heads(c: ModelConfig) -> Any:
    """Each query and KV head's rows of q, k and v (weights and biases): (name, rows)."""

    def of(a: str) -> list[tuple[str, int]]:
        heads = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
        return [
            (f"{a}{x}_proj.{kind}", n * c.head_dim)
            for x, n in heads.items()
            for kind in ("weight", "bias")
        ]

    return of


def _mla_heads(c: ModelConfig) -> Any:
    """Latent attention split as vLLM splits it: each head's rows of the query's up-projection
    (q_b, or q without LoRA) and of kv_b (its keys' and values' up-projection); the latent
    (q_a, kv_a and their norms) whole on every rank, and so its cache."""
    m = c.shape
    assert isinstance(m, MlaShape)
    qk, kv = m.nope_dim + m.rope_dim, m.nope_dim + m.v_dim
    query = "q_b_proj" if m.q_lora_rank is not None else "q_proj"

    def of(a: str) -> list[tuple[str, int]]:
        heads = c.num_heads
        return [(f"{a}{query}.weight", heads * qk), (f"{a}kv_b_proj.weight", heads * kv)]

    return of
