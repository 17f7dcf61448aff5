"""What the engine needs of a model: one forward pass over a batch and its paged cache.
DecoderModel (Llama-family and DeepSeek-V2/V3 layers) and DeepseekV4Model both are one."""

from __future__ import annotations

from typing import Protocol

import torch

from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache
from services.model.moe import Moe


class CausalLM(Protocol):
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    kernels: str  # attention.KERNELS, resolved
    embed: torch.Tensor  # [vocab, hidden], in the compute dtype

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] in float32; every row's KV is cached."""
        ...

    def new_kv_cache(
        self, num_blocks: int, block_size: int, num_window_blocks: int | None = None
    ) -> KVCache: ...

    def moe_layers(self) -> dict[int, Moe]:
        """The mixture-of-experts layers, by layer index (empty for dense models)."""
        ...

    def expert_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start, by MoE layer (empty for dense models)."""
        ...
