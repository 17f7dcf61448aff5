"""Seeds and the uniform numbers drawn from them, without torch (the router derives choice
seeds too, and does not load torch).

Determinism (docs/design.md): the draw for the token at position t of a sequence seeded s uses a
uniform number derived from (s, t) alone; choice i > 0 of a request seeded s is seeded
choice_seed(s, i).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser: a well-mixed 64-bit value per input (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """One number in [0, 1) per (seed, position), float64 [R]."""
    s = np.array([x & 0xFFFFFFFFFFFFFFFF for x in seeds], dtype=np.uint64)
    p = np.array(positions, dtype=np.uint64)
    bits = splitmix64(splitmix64(s) ^ p) >> np.uint64(11)  # 53 bits
    return bits.astype(np.float64) / float(1 << 53)


def choice_seed(seed: int, index: int) -> int:
    """Seed of choice `index` of a request seeded `seed` (choice 0 keeps the request's)."""
    if index == 0:
        return seed
    mixed = splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) ^ np.uint64(index))
    return int(mixed[0])
