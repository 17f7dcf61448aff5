"""The paged KV pool: fixed-size blocks of K and V for every layer.

Layout per layer: [num_blocks, block_size, kv_heads, head_dim], token-major within a block,
so one token's K (or V) is a contiguous [kv_heads, head_dim] row and a slot is a flat index
block * block_size + offset. Who owns which block is the block manager's business, not this
class's.
"""

from __future__ import annotations

import torch

from services.model.config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i: [num_blocks, block_size, kv_heads, head_dim] each."""
        return self.k[i], self.v[i]

    @property
    def bytes_per_block(self) -> int:
        per_layer = self.k[0, 0].numel() * self.k.element_size()
        return 2 * per_layer * self.k.shape[0]

    @staticmethod
    def blocks_for_bytes(config: ModelConfig, nbytes: int, block_size: int, itemsize: int) -> int:
        per_block = 2 * config.num_layers * block_size * config.kv_size * itemsize
        return max(1, nbytes // per_block)
