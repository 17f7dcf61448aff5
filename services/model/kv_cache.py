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

The pool is one pool per cache group (cache_spec.py): a group holds its layers' part of every
block. A group read for good has a block for every block, at the same index. A group whose part
is let go once out of every window (a sliding layer's K and V, DeepSeek-V4's window part) has
fewer blocks than there are blocks, given out by the block manager's pool for the group
(services/engine/group_pool.py): `table[block]` is the group's block for a block, -1 while it
has none; a batch carries each such group's table for its sequences (`ForwardBatch.tables`).

A slot is a flat token index: block * block_size + offset. This module is the only one that
knows the layouts (the C kernel in kernels/paged_attention.c mirrors them): `plain_views`
indexes either as the plain one. Who owns which block is the block manager's business.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys
from collections.abc import Mapping

import torch

from kvstore.block_hash import BLOCK_SIZE, KVLayout
from services.model.cache_spec import CacheGroup, CacheSpec
from services.model.config import ModelConfig


class GroupCache:
    """One group's pool: K [layers, blocks, heads, K elements, block_size] and V [layers,
    blocks, heads, block_size, V elements] in the dtype's layout, `layers` the group's."""

    def __init__(
        self,
        group: CacheGroup,
        spec: CacheSpec,
        num_blocks: int,
        group_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        index: int | None,
    ) -> None:
        self.group = group
        n, heads = len(group.layers), spec.heads
        self.k = _allocate((n, group_blocks, heads, group.k_width, block_size), dtype, device)
        self.v = _allocate((n, group_blocks, heads, block_size, group.v_width), dtype, device)
        # a group with blocks of its own: their table (this list is the block manager's group
        # pool's too), and its place among a batch's tables
        self.index = index
        self.table: list[int] | None = None
        if index is not None:
            self.table = (
                list(range(num_blocks)) if group_blocks == num_blocks else [-1] * num_blocks
            )

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the block's layer i."""
        j = self.group.layers.index(i)
        return self.k[j], self.v[j]

    def blocks_of(self, block_ids: list[int]) -> list[int]:
        """This group's block for each block (-1 where it has none)."""
        return list(block_ids) if self.table is None else [self.table[b] for b in block_ids]

    @property
    def bytes_per_block(self) -> int:
        return (self.k[:, 0].numel() + self.v[:, 0].numel()) * self.k.element_size()


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        group_blocks: Mapping[str, int] | None = None,
    ) -> None:
        """`group_blocks`: the blocks of each group whose part is let go early, by name
        (default: as many as there are blocks, each block's its own at first)."""
        self.spec = spec = config.cache_spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        groups, tables = [], 0
        for g in spec.groups:
            n = num_blocks if g.lasting else (group_blocks or {}).get(g.name, num_blocks)
            groups.append(GroupCache(g, spec, num_blocks, n, block_size, dtype, device,
                                     None if g.lasting else tables))  # fmt: skip
            tables += not g.lasting
        self.groups = tuple(groups)
        # the first group's pool (the whole pool, for a model with one group)
        self.k, self.v = self.groups[0].k, self.groups[0].v

    @property
    def mapped(self) -> tuple[GroupCache, ...]:
        """The groups with blocks of their own, in the order of a batch's tables."""
        return tuple(g for g in self.groups if g.table is not None)

    @property
    def whole(self) -> bool:
        """Whether one group holds every block whole (the first group's pool is the block)."""
        return len(self.groups) == 1

    def group(self, name: str) -> GroupCache:
        return next(g for g in self.groups if g.group.name == name)

    def group_of(self, i: int) -> GroupCache:
        """The group holding layer i (the first, where several hold parts of it)."""
        return next(g for g in self.groups if i in g.group.layers)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K [blocks, kv_heads, D, block_size] and V [blocks, kv_heads, block_size, D] of layer
        i, in the dtype's layout (of its group's blocks)."""
        return self.group_of(i).layer(i)

    def tables(self, block_ids: list[int]) -> tuple[list[int], ...]:
        """A sequence's table in each group with blocks of its own (-1 where released)."""
        return tuple(g.blocks_of(block_ids) for g in self.mapped)

    @property
    def bytes_per_block(self) -> int:
        """A block's bytes in the groups read for good (where every block has its part)."""
        return sum(g.bytes_per_block for g in self.groups if g.table is None)

    def block_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One block's K and V, all layers, in the plain layout's split views (what the store's
        codec decodes into): every group's part."""
        s, bs = self.spec, self.block_size
        return (s.layers, s.heads, s.k_dim // 2, 2, bs), (s.layers, s.heads, bs // 2, 2, s.v_dim)

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Blocks shaped [n, *block_shapes()] (on any device) into the given cache blocks."""
        device = self.k.device
        k = k.to(device, non_blocking=True).flatten(-3, -2)
        v = v.to(device, non_blocking=True).flatten(-3, -2)
        self.scatter(block_ids, k, v)

    def gather(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of whole blocks (gather_blocks); a pool spread over ranks gathers theirs."""
        return gather_blocks(self, block_ids)

    def scatter(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Blocks shaped as `gather` returns them into the given cache blocks (scatter_blocks)."""
        scatter_blocks(self, block_ids, k, v)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def plain(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pool indexed as the plain layout, [layers, blocks, ...] (plain_views), where one
        group holds every block whole: a stored value decodes straight into it."""
        return plain_views(self.k, self.v) if self.whole else None


def layout(model_id: str, kv_dtype: str, block_size: int, config: ModelConfig) -> KVLayout:
    """The layout of this model's blocks as the store and the seam know them."""
    s = config.cache_spec
    return KVLayout(
        model_id,
        kv_dtype,
        block_size,
        s.layers,
        s.heads,
        s.k_dim,
        None if s.v_dim == s.k_dim else s.v_dim,  # named only where V differs (MLA's: none)
        row_layout=s.row_layout,
    )


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


def read(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the K and V at token slots [T] of one layer: [T, kv_heads, D] each (what
    `write` stores there)."""
    block_size = v_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_pairs, v_pairs = plain_views(k_cache, v_cache)
    k = k_pairs[blocks, :, :, :, offsets]  # [T, kv_heads, D / 2, 2]
    return k.flatten(-2), v_pairs[blocks, :, offsets // 2, offsets % 2, :]


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
    V [n, L, kv_heads, bs, D] (gathered layer-major, viewed block-major). A group's part of a
    block that group has let go of is zeros: the block manager saves no such block."""
    device = cache.k.device
    if cache.whole:
        index = torch.tensor(block_ids, dtype=torch.int64, device=device)
        k, v = select_plain(cache.k, cache.v, 1, index)
        return k.transpose(0, 1), v.transpose(0, 1)
    s, n, bs = cache.spec, len(block_ids), cache.block_size
    k = cache.k.new_zeros(s.layers, n, s.heads, s.k_dim, bs)
    v = cache.v.new_zeros(s.layers, n, s.heads, bs, s.v_dim)
    for g in cache.groups:
        held, slots = _held(g, block_ids, device)
        if not held:
            continue
        gk, gv = select_plain(g.k, g.v, 1, slots)  # [group layers, held, ...]
        (k0, k1), (v0, v1) = g.group.k, g.group.v
        layers = torch.tensor(g.group.layers, device=device)[:, None]  # outer, with `rows`
        rows = torch.tensor(held, device=device)[None, :]
        k[layers, rows, :, k0:k1] = gk
        v[layers, rows, :, :, v0:v1] = gv
    return k.transpose(0, 1), v.transpose(0, 1)


def scatter_blocks(cache: KVCache, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write blocks shaped as `gather_blocks` returns them into the given cache blocks (each
    group's part into that group's block, where it has one)."""
    device = cache.k.device
    k, v = k.transpose(0, 1).to(cache.k.dtype), v.transpose(0, 1).to(cache.v.dtype)
    if cache.whole:
        index = torch.tensor(block_ids, dtype=torch.int64, device=device)
        _copy_plain(*plain_views(cache.k, cache.v), index, k, v)
        return
    for g in cache.groups:
        held, slots = _held(g, block_ids, device)
        if not held:
            continue
        (k0, k1), (v0, v1) = g.group.k, g.group.v
        layers = torch.tensor(g.group.layers, dtype=torch.int64, device=k.device)
        rows = torch.tensor(held, dtype=torch.int64, device=k.device)
        part_k = k.index_select(0, layers).index_select(1, rows)[..., k0:k1, :]
        part_v = v.index_select(0, layers).index_select(1, rows)[..., v0:v1]
        k_plain, v_plain = plain_views(g.k, g.v)
        _copy_plain(k_plain, v_plain, slots, part_k, part_v)


def _held(
    g: GroupCache, block_ids: list[int], device: torch.device
) -> tuple[list[int], torch.Tensor]:
    """Which of the blocks have a block in this group, and those blocks."""
    own = g.blocks_of(block_ids)
    held = [i for i, b in enumerate(own) if b >= 0]
    return held, torch.tensor([own[i] for i in held], dtype=torch.int64, device=device)


def _copy_plain(
    k_plain: torch.Tensor,
    v_plain: torch.Tensor,
    index: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Blocks K [L, n, H, D, bs], V [L, n, H, bs, D] into plain views at `index` (dimension
    pairs of K, token pairs of V: the plain views' split, sizes spelled out: MLA's V has no
    elements)."""
    k_plain.index_copy_(1, index, k.reshape(*k.shape[:3], k.shape[3] // 2, 2, k.shape[4]))
    v_plain.index_copy_(1, index, v.reshape(*v.shape[:3], v.shape[3] // 2, 2, v.shape[4]))
