"""What the engine needs of a model: one forward pass over a batch and its paged cache, and
what the model can do besides, declared (`Capabilities`) rather than found out by its class.
Every family's model is one (families/)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from services.model.batch import ForwardBatch, SeqChunk
from services.model.blend import BlendChoice
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache
from services.model.layers.moe import Moe


@dataclass(frozen=True)
class Capabilities:
    """What a model supports beyond its forward pass, for a given config."""

    # decode steps replayed from captured CUDA graphs (services/engine/graphs.py)
    cuda_graphs: bool = False
    # --quantization int8 (loading/quantize.py)
    int8: bool = False
    # keeps its last pass's hidden rows in `hidden` when `keep_hidden` is set, which is what
    # its checkpoint's MTP layer drafts from
    hidden_rows: bool = False
    # `blend`: a prompt computed over K/V placed from elsewhere, some rows recomputed
    # (services/model/blend.py; approximate KV reuse, services/engine/chunk_reuse.py)
    approximate_reuse: bool = False


class CausalLM(Protocol):
    config: ModelConfig
    capabilities: Capabilities
    dtype: torch.dtype
    device: torch.device
    kernels: str  # attention.KERNELS, resolved
    embed: torch.Tensor  # [vocab, hidden], in the compute dtype
    # keep the next passes' hidden rows in `hidden` (where capabilities.hidden_rows)
    keep_hidden: bool

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] in float32; every row's KV is cached."""
        ...

    def new_kv_cache(
        self, num_blocks: int, block_size: int, group_blocks: Mapping[str, int] | None = None
    ) -> KVCache:
        """A pool of `num_blocks` blocks (`group_blocks`: kv_cache.KVCache's)."""
        ...

    def moe_layers(self) -> dict[int, Moe]:
        """The mixture-of-experts layers, by layer index (empty for dense models)."""
        ...

    def expert_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start, by MoE layer (empty for dense models)."""
        ...


class Blends(Protocol):
    """A model whose capabilities say `approximate_reuse` (services/model/blend.py)."""

    def blend(
        self, chunk: SeqChunk, kv: KVCache, choose: BlendChoice, check: int = 1
    ) -> tuple[list[int], torch.Tensor]: ...

    def key_rotation(self) -> tuple[int, torch.Tensor]:
        """Where a cached key's rotary part starts, and its inverse frequencies: keys moved
        by d positions are that part turned by d (rotate-half form)."""
        ...


class MtpLayer(Protocol):
    """A checkpoint's multi-token-prediction layer (its family's MTP module loads it): from a
    row's token and the target's hidden state before it, a guess at the token after next."""

    config: ModelConfig
    device: torch.device

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache: ...

    def forward(
        self, batch: ForwardBatch, kv: KVCache, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits at batch.logits_rows (float32) and every row's own hidden state, which the
        next draft of the chain reads as its `previous`."""
        ...
