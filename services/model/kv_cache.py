"""The paged KV pool: fixed-size blocks of K and V for every layer, and its layouts.

Per layer, a block holds `block_size` tokens of one sequence, grouped by KV head. The plain
layout, the one blocks are stored and moved in (kvstore's codec), and a float32 cache's:

    K: [num_blocks, kv_heads, head_dim, block_size]   (a head's keys transposed: a row of
                                                       the block per dimension)
    V: [num_blocks, kv_heads, block_size, head_dim]   (a row per token)

K is transposed so that attention scores a whole block at once with vector arithmetic along
the tokens (as vLLM's key cache does); V keeps a row per token so the weighted sum runs along
the head dimension. A bfloat16 cache holds the same tensors' shapes, with each block's elements
in pairs, the order a bfloat16 dot-product instruction takes (VDPBF16PS: a float32 lane sums
two products):

    K: [.., head_dim / 2, block_size, 2]   (dimensions 2j and 2j + 1 of a token side by side)
    V: [.., block_size / 2, head_dim, 2]   (tokens 2j and 2j + 1 of a dimension side by side)

MLA's cache (config.cache_shape) is K alone: one "head" of latent + rotary key per token, and
a V of no dimensions.

A slot is a flat token index: block * block_size + offset. This module is the only one that
knows the layouts (the C kernel in kernels/paged_attention.c mirrors them): `plain_views`
indexes either as the plain one. Who owns which block is the block manager's business.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys

import torch

from kvstore.block_hash import BLOCK_SIZE, KVLayout
from services.model.config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_window_blocks: int | None = None,
    ) -> None:
        """`num_window_blocks`: for a model with a window part, the size of its pool; None:
        one per block, each block's its own (`window_of`)."""
        layers, (heads, k_dim, v_dim) = config.cache_layers, config.cache_shape
        # The window part of a block (V4: the last window_width elements of K; gpt-oss and
        # Gemma 3: their sliding layers whole) lives in a window block of its own,
        # window_of[block] (-1: released). The block manager assigns them; this module and
        # the models read it.
        self.window_width = config.window_width
        self.window_layers = config.window_layers
        self.main_layers = tuple(i for i in range(layers) if i not in self.window_layers)
        n = num_blocks if num_window_blocks is None else num_window_blocks
        n = n if self.windowed else 0
        if self.window_width:
            main = (layers, num_blocks, heads, k_dim - self.window_width, block_size)
            window = (layers, n, heads, self.window_width, block_size)
            v_window = (layers, n, heads, block_size, 0)
        else:
            main = (len(self.main_layers), num_blocks, heads, k_dim, block_size)
            window = (len(self.window_layers), n, heads, k_dim, block_size)
            v_window = (len(self.window_layers), n, heads, block_size, v_dim)
        self.k = _allocate(main, dtype, device)
        self.v = _allocate((*main[:3], block_size, v_dim), dtype, device)
        self.k_plain, self.v_plain = plain_views(self.k, self.v)  # for whole-block copies
        self.wk, self.wv = _allocate(window, dtype, device), _allocate(v_window, dtype, device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window_of = list(range(num_blocks)) if n == num_blocks else [-1] * num_blocks

    @property
    def windowed(self) -> bool:
        """Whether part of every block lives in window blocks."""
        return bool(self.window_width or self.window_layers)

    @property
    def num_window_blocks(self) -> int:
        return int(self.wk.shape[1])

    def in_window(self, i: int) -> bool:
        """Whether layer i is held in window blocks (read through the window tables)."""
        return i in self.window_layers

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K [blocks, kv_heads, D, block_size] and V [blocks, kv_heads, block_size, D], in the
        dtype's layout (of the window blocks, for a layer held there)."""
        if i in self.window_layers:
            j = self.window_layers.index(i)
            return self.wk[j], self.wv[j]
        j = self.main_layers.index(i)
        return self.k[j], self.v[j]

    def window_table(self, block_ids: list[int]) -> list[int]:
        """The window block of each of a sequence's blocks (-1 where released)."""
        return [self.window_of[b] for b in block_ids]

    @property
    def bytes_per_block(self) -> int:
        return (self.k[:, 0].numel() + self.v[:, 0].numel()) * self.k.element_size()

    @property
    def bytes_per_window_block(self) -> int:
        if not self.windowed:
            return 0
        return (self.wk[:, 0].numel() + self.wv[:, 0].numel()) * self.wk.element_size()

    def block_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One block's K and V, all layers, in the plain layout's split views (what the store's
        codec decodes into): window part included."""
        _, _, heads, k_dim, bs = self.k.shape
        layers = len(self.main_layers) + (0 if self.window_width else len(self.window_layers))
        k_dim += self.window_width
        return (layers, heads, k_dim // 2, 2, bs), (layers, heads, bs // 2, 2, self.v.shape[-1])

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Blocks shaped [n, *block_shapes()] (on any device) into the given cache blocks."""
        device = self.k.device
        k = k.to(device, non_blocking=True).flatten(-3, -2)
        v = v.to(device, non_blocking=True).flatten(-3, -2)
        scatter_blocks(self, block_ids, k, v)


def layout(model_id: str, kv_dtype: str, block_size: int, config: ModelConfig) -> KVLayout:
    """The layout of this model's blocks as the store and the seam know them."""
    heads, k_dim, v_dim = config.cache_shape
    return KVLayout(
        model_id, kv_dtype, block_size, config.cache_layers, heads, k_dim,
        None if v_dim == k_dim else v_dim,  # named only where V differs (MLA's latent: none)
        row_layout="v4: shares, then window part" if config.window_width else None,
    )  # fmt: skip


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed tensor. On Linux CPUs, anonymous memory of its own: the kernel hands out its
    pages zeroed as they are first written, so a pool costs time and memory only for the
    blocks in use (a worker's thousands of blocks start at once), and they come as transparent
    huge pages where the kernel allows.

    Decode attention visits blocks scattered over the whole pool: with 4 KiB pages nearly every
    block costs a TLB miss, with 2 MiB pages almost none. Zeroed, not merely allocated: a
    padding slot's V is multiplied by a zero weight, and garbage could be a NaN.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or sys.platform != "linux" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes)  # private, anonymous: zero pages, faulted in on first write
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype).view(shape)  # the tensor keeps the region


def paired(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds its blocks' elements in pairs."""
    return dtype == torch.bfloat16


def plain_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of caches ([..., D, bs] and [..., bs, D], contiguous, in their dtype's layout)
    indexed as the plain layout, one dimension split in two: K [..., D / 2, 2, bs] (dimension d
    at d // 2, d % 2) and V [..., bs / 2, 2, D] (token t at t // 2, t % 2)."""
    *lead, dim, bs = k_cache.shape
    v_dim = v_cache.shape[-1]
    if paired(k_cache.dtype):
        k = k_cache.view(*lead, dim // 2, bs, 2).transpose(-1, -2)
        v = v_cache.view(*lead, bs // 2, v_dim, 2).transpose(-1, -2)
        return k, v
    return k_cache.view(*lead, dim // 2, 2, bs), v_cache.view(*lead, bs // 2, 2, v_dim)


def select_plain(
    k_cache: torch.Tensor, v_cache: torch.Tensor, dim: int, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the blocks at `index` along `dim`, in the plain layout: K [..., D, bs], V [...,
    bs, D]. Selected from the cache as it lies, then rearranged (a second copy when paired, of
    the selected blocks only): index_select on the plain views would copy the whole pool first
    (a strided source), 2.8 s for a 4,000-block pool per finished request's write-back."""
    k, v = plain_views(k_cache.index_select(dim, index), v_cache.index_select(dim, index))
    return k.flatten(-3, -2), v.flatten(-3, -2)


def write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store k, v ([T, kv_heads, D]) at token slots [T] of one layer."""
    block_size = v_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_pairs, v_pairs = plain_views(k_cache, v_cache)
    k_pairs[blocks, :, :, :, offsets] = k.reshape(*k.shape[:2], -1, 2)
    v_pairs[blocks, :, offsets // 2, offsets % 2, :] = v


def gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the blocks of `table` ([..., n]), token-major: K [..., n * bs, kv_heads, D],
    V [..., n * bs, kv_heads, D_v]."""
    lead, n = table.shape[:-1], table.shape[-1]
    flat = table.flatten()  # index_select on a flat index is ~10x faster than fancy indexing
    _, heads, dim, bs = k_cache.shape
    v_dim = v_cache.shape[-1]
    k, v = select_plain(k_cache, v_cache, 0, flat)
    k = k.view(*lead, n, heads, dim, bs).transpose(-1, -3)
    v = v.view(*lead, n, heads, bs, v_dim).transpose(-2, -3)
    k = k.transpose(-1, -2).reshape(*lead, n * bs, heads, dim)
    return k, v.reshape(*lead, n * bs, heads, v_dim)


def gather_blocks(cache: KVCache, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of whole blocks, all layers each, in the plain layout: K [n, L, kv_heads, D, bs],
    V [n, L, kv_heads, bs, D] (gathered layer-major, viewed block-major). A block's window
    part (V4: after its K; else its window layers) is zeros where released: the block manager
    saves no such block."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=cache.k.device)
    k, v = select_plain(cache.k, cache.v, 1, index)
    if cache.windowed:
        wk = k.new_zeros(cache.wk.shape[0], len(block_ids), *cache.wk.shape[2:])
        wv = v.new_zeros(cache.wv.shape[0], len(block_ids), *cache.wv.shape[2:])
        held, slots = _held(cache, block_ids)
        if held:
            wk[:, held], wv[:, held] = select_plain(cache.wk, cache.wv, 1, slots)
        k, v = _join(cache, k, wk), _join(cache, v, wv, values=True)
    return k.transpose(0, 1), v.transpose(0, 1)


def scatter_blocks(cache: KVCache, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write blocks shaped as `gather_blocks` returns them into the given cache blocks (the
    window part into the block's window block, where it has one)."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=cache.k.device)
    k, v = k.transpose(0, 1).to(cache.k.dtype), v.transpose(0, 1).to(cache.v.dtype)
    if cache.windowed:
        (k, wk), (v, wv) = _split(cache, k), _split(cache, v, values=True)
        held, slots = _held(cache, block_ids)
        if held:
            wk_plain, wv_plain = plain_views(cache.wk, cache.wv)
            _copy_plain(wk_plain, wv_plain, slots, wk[:, held], wv[:, held])
    _copy_plain(cache.k_plain, cache.v_plain, index, k, v)


def _held(cache: KVCache, block_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """Which of the blocks have a window block, and those window blocks."""
    held = [i for i, b in enumerate(block_ids) if cache.window_of[b] >= 0]
    slots = [cache.window_of[block_ids[i]] for i in held]
    return held, torch.tensor(slots, dtype=torch.int64, device=cache.k.device)


def _join(cache: KVCache, main: torch.Tensor, window: torch.Tensor, values: bool = False):
    """Blocks [L, n, ...] of the whole layout from the two pools' parts."""
    if cache.window_width:  # V4: K's elements after the main part's; V has none
        return main if values else torch.cat((main, window), dim=-2)
    out = main.new_empty(len(cache.main_layers) + len(cache.window_layers), *main.shape[1:])
    out[list(cache.main_layers)] = main
    out[list(cache.window_layers)] = window
    return out


def _split(
    cache: KVCache, blocks: torch.Tensor, values: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two pools' parts of blocks [L, n, ...] of the whole layout (`_join` undone)."""
    if cache.window_width:
        if values:  # V4's V has no elements, in either pool
            return blocks, blocks
        main = blocks.shape[-2] - cache.window_width
        return blocks[..., :main, :], blocks[..., main:, :]
    return blocks[list(cache.main_layers)], blocks[list(cache.window_layers)]


def _copy_plain(
    k_plain: torch.Tensor, v_plain: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor,
) -> None:  # fmt: skip
    """Blocks K [L, n, H, D, bs], V [L, n, H, bs, D] into plain views at `index` (dimension
    pairs of K, token pairs of V: the plain views' split, sizes spelled out: MLA's V has no
    elements)."""
    k_plain.index_copy_(1, index, k.reshape(*k.shape[:3], k.shape[3] // 2, 2, k.shape[4]))
    v_plain.index_copy_(1, index, v.reshape(*v.shape[:3], v.shape[3] // 2, 2, v.shape[4]))
