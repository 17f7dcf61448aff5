"""DeepSeek-V4's cache rows in the paged pools: reading and writing one layer's part of a
token's rows (config.LayerRow), and its rotary embedding.

The pools are kv_cache.py's groups: the shares in the "v4 shares" group's blocks, the window
part in the "v4 window" group's (config.cache_spec), each one "layer" wide enough for every
layer's part: a slot is a token, and `write` / `read`
address a span of elements of it. Whatever the dtype's layout, they go through
kv_cache.plain_views, the only code that knows it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from services.model import kernels, kv_cache
from services.model.config import ModelConfig, RopeScaling
from services.model.families.deepseek_v4.config import SHARES, WINDOW_PART, v4_of
from services.model.layers import pointwise
from services.model.layers.rope import inverse_frequencies


@dataclass(frozen=True)
class Pools:
    """What a pass reads and writes: shares [blocks, 1, S, bs] through the block tables, the
    window part [window blocks, 1, W, bs] through the window group's tables."""

    shares: torch.Tensor
    window: torch.Tensor
    window_table: int | None  # the window group's table in a batch (ForwardBatch.tables)

    @classmethod
    def of(cls, kv: kv_cache.KVCache) -> Pools:
        window = kv.group(WINDOW_PART)
        return cls(kv.group(SHARES).k[0], window.k[0], window.index)


def write(cache: torch.Tensor, slots: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """values [n, w] into elements [offset, offset + w) of the rows at `slots` [n]."""
    bs = cache.shape[-1]
    k, _ = kv_cache.plain_views(cache, cache.new_empty(*cache.shape[:2], bs, 0))
    lo, hi = offset // 2, (offset + values.shape[1]) // 2
    k[slots // bs, 0, lo:hi, :, slots % bs] = values.reshape(len(slots), hi - lo, 2).to(k.dtype)


def read(cache: torch.Tensor, slots: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """Elements [offset, offset + width) of the rows at `slots` [n]: [n, width] (a copy; in C
    on CPUs, kernels/rows.c)."""
    library = _library()
    if library is not None and cache.device.type == "cpu" and cache.dtype in _C_DTYPES:
        blocks, _, dim, bs = cache.shape
        if len(slots) and not 0 <= int(slots.min()) <= int(slots.max()) < blocks * bs:
            raise IndexError(f"a slot outside the pool's {blocks * bs}")  # a released part
        slots, out = slots.contiguous(), cache.new_empty(len(slots), width)
        fn = library.rows_read_pairs if kv_cache.paired(cache.dtype) else library.rows_read_f32
        fn(cache.contiguous().data_ptr(), slots.data_ptr(), len(slots), dim, bs, offset, width,
           out.data_ptr())  # fmt: skip
        return out
    bs = cache.shape[-1]
    k, _ = kv_cache.plain_views(cache, cache.new_empty(*cache.shape[:2], bs, 0))
    lo, hi = offset // 2, (offset + width) // 2
    return k[slots // bs, 0, lo:hi, :, slots % bs].reshape(len(slots), width)


_C_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = kernels.load("rows")
    if library is not None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for fn in (library.rows_read_f32, library.rows_read_pairs):
            fn.restype = None
            fn.argtypes = [p, p, i64, i64, i64, i64, i64, p]
    return library


def slots_of(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots of a sequence's tokens at `positions`, through its block table."""
    return table[positions // block_size] * block_size + positions % block_size


class V4Rope:
    """V4's two rope sets over the last `rope_dim` dimensions of a head, rotated in adjacent
    pairs: "main" (sliding layers) and "compress" (CSA and HCA layers, YaRN where configured,
    cos and sin unscaled). cos/sin are computed per call from the positions, in the model's
    dtype, and applied in float32, as transformers does."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        v4 = v4_of(config)
        self.dim, self.dtype = v4.rope_dim, dtype
        yarn = None
        if v4.compress_yarn is not None:
            y = v4.compress_yarn
            yarn = RopeScaling(
                "yarn",
                y["factor"],
                beta_fast=y["beta_fast"],
                beta_slow=y["beta_slow"],
                original_max_position_embeddings=int(y["original_max_position_embeddings"]),
            )
        self.inv_freq = {
            "main": inverse_frequencies(self.dim, config.rope_theta, None).to(device),
            "compress": inverse_frequencies(self.dim, v4.compress_rope_theta, yarn).to(device),
        }

    def tables(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, rope_dim / 2] (float32 values of the model dtype's)."""
        freqs = positions.float()[:, None] * self.inv_freq[kind]
        cos, sin = pointwise.cos(freqs), pointwise.sin(freqs)
        return cos.to(self.dtype).float(), sin.to(self.dtype).float()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, ..., D] with its last rope_dim rotated by cos/sin [n, rope_dim / 2]."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        nope, rope = x[..., : -self.dim], x[..., -self.dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
        return torch.cat((nope, rotated.flatten(-2).to(x.dtype)), dim=-1)
