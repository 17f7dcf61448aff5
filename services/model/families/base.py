"""What the models that load their own layers share (DeepseekV4Model, GptOssModel,
Gemma3Model): the device, dtype and kernels chosen once, matrix products in the device's best
layout (linear.py: each row's bits the same at every row count), a pool in kv_cache.py's
layouts. A subclass reads its weights in `load`."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvstore.block_hash import BLOCK_SIZE
from services.model.causal_lm import Capabilities
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache
from services.model.layers.attention import resolve_kernels
from services.model.layers.linear import (
    Linear,
    amx_linear_library,
    make_linear,
    make_logits_linear,
    packed_linear_available,
)
from services.model.layers.moe import Moe
from services.settings import DEFAULTS


class PagedModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: str = DEFAULTS.model.kernels,
        deterministic: bool = DEFAULTS.model.deterministic,
    ) -> None:
        """`kernels`: attention.KERNELS; on a GPU ("triton") these models run their torch
        code, with the row attention in Triton (gpu/row_attention.py); `deterministic`:
        row-invariant products there (linear.make_linear)."""
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.kernels = resolve_kernels(kernels, self.device)
        self.packed = packed_linear_available(self.device, dtype)
        self.deterministic = deterministic
        self.capabilities = self.supports(config)
        self.keep_hidden = False  # (a model whose capabilities say hidden_rows keeps them)
        self.quantization = DEFAULTS.model.quantization  # quantize.quantize_int8 sets "int8"
        self._amx = amx_linear_library() if self.packed and dtype == torch.bfloat16 else None
        self.load(weights)

    @classmethod
    def supports(cls, config: ModelConfig) -> Capabilities:
        """Its torch code: no CUDA graphs, no int8 weights (docs/design.md says why)."""
        return Capabilities()

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def product(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """x @ weight.T (+ bias), weight [out, in] in its dtype (float32 ones for a float32
        input, as the hyper-connections' mixes)."""
        amx = self._amx if weight.dtype == torch.bfloat16 else None
        return make_linear(weight.contiguous(), bias, self.packed, amx, self.deterministic)

    def logits_product(self, weight: torch.Tensor) -> Linear:
        """The output head: float32 logits (linear.make_logits_linear)."""
        amx = self._amx if weight.dtype == torch.bfloat16 else None
        return make_logits_linear(weight.contiguous(), self.packed, amx, self.deterministic)

    def new_kv_cache(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        group_blocks: Mapping[str, int] | None = None,
    ) -> KVCache:
        return KVCache(self.config, num_blocks, block_size, self.dtype, self.device, group_blocks)

    def moe_layers(self) -> dict[int, Moe]:
        return {}

    def expert_counts(self) -> dict[int, list[int]]:
        return {i: moe.counts.tolist() for i, moe in self.moe_layers().items()}
