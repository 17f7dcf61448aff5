"""What a model keeps of each token in the paged cache: its layers' cache state, in groups.

A block holds 16 tokens' state of every layer; as the store and the seam know it (kv_cache.py,
kvstore's codec) that is K [layers, heads, k_dim, 16] and V [layers, heads, 16, v_dim]. Layers
whose state lives alike form a group, and each group has a pool of its own (kv_cache.py) and
a rule for how long a token's part is read (`keep`):

    group              layers            K elements      V elements   read
    full attention     every layer       [0, head_dim)   [0, head_dim) for good
    sliding window     gpt-oss's odd     [0, head_dim)   [0, head_dim) while within the window
    MLA latent         every layer       [0, 576)        none         for good
    V4 shares          one, every layer  [0, S)          none         for good
    V4 window part     the same one      [S, S + W)      none         while within the window

A family declares its groups (services/model/families/); the pools, the block manager's group
pools (services/engine/group_pool.py), the connectors and the codec move groups without asking
which kind they are. No torch here: the router reads configs too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheGroup:
    """Part of a block: K elements `k` and V elements `v` ([start, end) of a token's row) of
    the block's layers `layers`."""

    name: str
    layers: tuple[int, ...]
    k: tuple[int, int]
    v: tuple[int, int]
    # A token's part is read only by passes whose first new token is at most `keep` tokens
    # after it (a sliding window); its pool lets go of it after that. None: read for good.
    keep: int | None = None

    @property
    def k_width(self) -> int:
        return self.k[1] - self.k[0]

    @property
    def v_width(self) -> int:
        return self.v[1] - self.v[0]

    @property
    def lasting(self) -> bool:
        return self.keep is None


@dataclass(frozen=True)
class CacheSpec:
    """A block's shape and the groups that hold it: every element of every layer in exactly
    one group."""

    layers: int
    heads: int
    k_dim: int
    v_dim: int
    groups: tuple[CacheGroup, ...]
    # how a token's row is laid out, where a family says (named in the store's namespace only
    # when set, so that every other layout keeps its keys)
    row_layout: str | None = None

    def __post_init__(self) -> None:
        for layer in range(self.layers):
            k = sorted(g.k for g in self.groups if layer in g.layers)
            v = sorted(g.v for g in self.groups if layer in g.layers and g.v_width)
            if not _tiles(k, self.k_dim) or not _tiles(v, self.v_dim):
                raise ValueError(f"cache groups do not tile layer {layer}'s row exactly once")
        if any(g.k[0] % 2 or g.k_width % 2 for g in self.groups):
            raise ValueError("a group's K elements must start and end even (bfloat16 pairs)")

    @classmethod
    def uniform(
        cls, layers: int, heads: int, k_dim: int, v_dim: int, name: str = "full"
    ) -> CacheSpec:
        """One group: every layer's K and V, kept for good."""
        group = CacheGroup(name, tuple(range(layers)), (0, k_dim), (0, v_dim))
        return cls(layers, heads, k_dim, v_dim, (group,))

    @classmethod
    def by_layer(cls, heads: int, head_dim: int, windows: tuple[int | None, ...]) -> CacheSpec:
        """Per-head K and V of every layer, a layer read for good (window None) or within its
        sliding window: a group for the full layers, one for each window size."""
        groups = [
            CacheGroup(
                "full",
                tuple(i for i, w in enumerate(windows) if w is None),
                (0, head_dim),
                (0, head_dim),
            )
        ]
        for w in sorted({w for w in windows if w is not None}):
            layers = tuple(i for i, x in enumerate(windows) if x == w)
            # a pass reads, before its first new token, the window - 1 tokens the first sees
            groups.append(CacheGroup(f"window {w}", layers, (0, head_dim), (0, head_dim), w - 1))
        kept = tuple(g for g in groups if g.layers)
        return cls(len(windows), heads, head_dim, head_dim, kept)

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """A token's row per layer: (heads, K elements, V elements)."""
        return self.heads, self.k_dim, self.v_dim

    @property
    def elements(self) -> int:
        """Cache elements per token, every layer."""
        return self.layers * self.heads * (self.k_dim + self.v_dim)

    def group_elements(self, group: CacheGroup) -> int:
        """Cache elements per token in one group."""
        return len(group.layers) * self.heads * (group.k_width + group.v_width)

    @property
    def lasting(self) -> bool:
        """Whether every group is read for good (no part of a block is ever let go early)."""
        return all(g.lasting for g in self.groups)


def _tiles(spans: list[tuple[int, int]], width: int) -> bool:
    """Whether sorted [start, end) spans cover [0, width) exactly once."""
    at = 0
    for start, end in spans:
        if start != at or end < start:
            return False
        at = end
    return at == width
