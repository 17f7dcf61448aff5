"""Rounding float32 to a storage dtype inside Triton kernels, alike compiled and interpreted."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x rounded to dtype, to nearest even. For bfloat16 the rounding is done here
    because Triton's interpreter truncates (its cast drops the low bits); on a GPU the cast
    rounds to nearest even itself and this is the same result."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
