"""DeepSeek-V4 over tensor ranks (docs/parallel.md; parallel/plan.py asks this module).

Each rank holds its heads' rows of the query's up-projection (wq_b) and their sinks, its
groups of the grouped output projection (wo_a: a group's heads stay together, so the rank
count divides o_groups) and its columns of wo_b, whose input (every group's output) and output
are all-gathered. The shared K=V head, the compressors, the indexer (its top-k sums scores
over its heads: split, the sum's order would change) and the hyper-connections stay whole on
every rank, and so does the cache: one pool, the same on every rank. The routed experts spread
over the ranks as the Llama family's do; the embedding and the head split by vocabulary.
No torch here at import: the settings check reads the sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from services.model.config import ModelConfig
from services.model.families.deepseek_v4.config import v4_of

cache_whole = True  # every rank's pool holds every block whole: saved from rank 0's


def sizes(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, size, unit): each size must be a multiple of the rank count times its unit."""
    c, v4 = config, v4_of(config)
    assert c.moe is not None
    return [
        ("num_heads", c.num_heads, 1), ("o_groups", v4.o_groups, 1),
        ("hidden_size", c.hidden_size, 16), ("vocab_size", c.vocab_size, 16),
        ("num_experts", c.moe.num_experts, 1),
    ]  # fmt: skip


def rows(config: ModelConfig, part: Callable[[int], slice]) -> dict[str, slice]:
    """This rank's rows of each split tensor (`part(total)`: its share of `total` rows)."""
    c, v4 = config, v4_of(config)
    out = {"embed.weight": part(c.vocab_size), "head.weight": part(c.vocab_size)}
    for i in range(c.num_layers):
        a = f"layers.{i}.attn."
        out |= {
            a + "wq_b.weight": part(c.num_heads * c.head_dim), a + "attn_sink": part(c.num_heads),
            a + "wo_a.weight": part(v4.o_groups * v4.o_lora_rank),
            a + "wo_b.weight": part(c.hidden_size),
        }  # fmt: skip
    return out


def sliced(
    config: ModelConfig, weights: dict[str, Any], rank: int, size: int
) -> tuple[ModelConfig, dict[str, Any]]:
    """A rank's config (its heads and groups) and weights (a tied head: the embedding's rows)."""
    if config.tie_word_embeddings:
        weights["head.weight"] = weights["embed.weight"]
    v4 = v4_of(config)
    mine = dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        tie_word_embeddings=False,
        shape=dataclasses.replace(v4, o_groups=v4.o_groups // size),
    )
    return mine, weights


def parallelize(model: Any, group: Any, experts: bool) -> None:
    """The exchanges around a rank's model: wo_b between its all-gathers, the experts spread
    (`experts` False: left whole for a data-parallel grid's exchange), head and embedding by
    vocabulary."""
    from services.model.parallel.tensor import Gathered, TensorExperts, VocabularySlice

    for i, layer in enumerate(model.layers):
        o_b = Gathered(layer.attention.o_b, group, whole_input=True)
        if experts:
            TensorExperts(layer.moe, group)
        attention = dataclasses.replace(layer.attention, o_b=o_b)
        model.layers[i] = dataclasses.replace(layer, attention=attention)
    model.lm_head = Gathered(model.lm_head, group, whole_input=False)
    model.lookup = VocabularySlice(model.embed, group, model.config.vocab_size)
