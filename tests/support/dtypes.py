"""The dtypes whose results tests pin down exactly: every dtype `--dtype auto` may choose on
this CPU. float32 everywhere; bfloat16 where the CPU has bf16 instructions (AVX512-BF16 or
AMX), the CPUs on which auto picks it, skipped with the reason elsewhere (torch emulates it
there at well under 1% of float32's speed: nobody serves in it)."""

from __future__ import annotations

import pytest

from services.model.loader import cpu_has_bf16_units

__all__ = ["COMPUTE_DTYPES", "cpu_has_bf16_units"]

NO_BF16 = "this CPU has no bf16 instructions (avx512_bf16, amx_bf16): auto picks float32 here"

# for @pytest.mark.parametrize("dtype", COMPUTE_DTYPES): the names load_model takes
COMPUTE_DTYPES = [
    pytest.param("float32", id="float32"),
    pytest.param(
        "bfloat16",
        id="bfloat16",
        marks=pytest.mark.skipif(not cpu_has_bf16_units(), reason=NO_BF16),
    ),
]
