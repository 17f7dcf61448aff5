"""DeepSeek-V3.2 over tensor ranks (docs/parallel.md; parallel/plan.py asks this module).

Split as DeepSeek-V3 is (its heads' rows of q_b and kv_b, the latent whole, o between
all-gathers: plan.py's and tensor.py's defaults); the indexer stays whole on every rank (its
top-k sums scores over its heads), and so does the cache. One thing more: the sparse
attention's two products over the heads (scores = queries x latents, then their softmax x the
latents) are GEMMs whose rows' bits depend on how many rows the GEMM takes, so each rank
computes them at the whole head count, its heads at their own rows and zeros in the others'
(IndexedAttention.heads_at): a rank then computes as much of those products as one process
does, and its heads' rows are one process's, bit for bit.
No torch here at import: the settings check reads the sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.model.config import ModelConfig
from services.model.parallel import plan

cache_whole = True  # one latent (and one indexer key) for every head: saved from rank 0's


def sizes(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, size, unit): each size must be a multiple of the rank count times its unit."""
    return plan.default_sizes(config)


def rows(config: ModelConfig, part: Callable[[int], slice]) -> dict[str, slice]:
    """This rank's rows of each split tensor: DeepSeek-V3's (the indexer's not named: whole)."""
    return plan.default_rows(config, part)


def sliced(
    config: ModelConfig, weights: dict[str, Any], rank: int, size: int
) -> tuple[ModelConfig, dict[str, Any]]:
    """A rank's config (its heads) and weights (a tied head: the embedding's rows)."""
    from services.model.parallel.tensor import default_sliced

    return default_sliced(config, weights, size)


def parallelize(model: Any, group: Any, experts: bool) -> None:
    """DeepSeek-V3's exchanges, and the sparse attention's products at the whole head count."""
    from services.model.parallel.tensor import default_parallelize

    default_parallelize(model, group, experts)
    heads = model.config.num_heads  # this rank's
    model.indexed.heads_at = (group.rank * heads, heads * group.size)
