"""The products benchmark runs end to end (tiny sizes): one row per shape and row count where
the AMX tiles run, or where kernels/bf16_linear.c does (AVX512-BF16, no AMX), and a one-line
reason and exit status 1 where neither does."""

from __future__ import annotations

from bench import linear
from services.model.layers.linear import amx_linear_library, bf16_linear_library


def test_linear_benchmark_smoke(capsys):
    status = linear.main(["--rows", "1,17", "--rounds", "1"])
    out = capsys.readouterr().out
    if amx_linear_library() is None and bf16_linear_library() is None:
        assert status == 1 and "neither AMX tiles nor AVX512-BF16 here" in out
        return
    assert status == 0
    rows = [line.split("|") for line in out.splitlines() if line[2:3].isdigit()]
    # five shapes at 1 and 17 rows (the head too: 17 <= HEAD_ROWS)
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        (f"{o} x {i}", str(m)) for o, i in linear.SHAPES for m in (1, 17)
    ]
    # ours, then oneDNN (AVX-512 and AMX where the tiles run): every time measured
    timed = (3, 5, 6) if amx_linear_library() is not None else (3, 5)
    assert all(float(r[c]) > 0 for r in rows for c in timed)
    if amx_linear_library() is None:
        assert "bf16_linear.c us" in out
