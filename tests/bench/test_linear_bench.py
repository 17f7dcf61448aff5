"""The products benchmark runs end to end (tiny sizes): one row per shape and row count where
the AMX tiles run, a one-line reason and exit status 1 where they do not."""

from __future__ import annotations

from bench import linear
from services.model.layers.linear import amx_linear_library


def test_linear_benchmark_smoke(capsys):
    status = linear.main(["--rows", "1,17", "--rounds", "1"])
    out = capsys.readouterr().out
    if amx_linear_library() is None:
        assert status == 1 and "no AMX tiles here" in out
        return
    assert status == 0
    rows = [line.split("|") for line in out.splitlines() if line[2:3].isdigit()]
    # five shapes at 1 and 17 rows (the head too: 17 <= HEAD_ROWS)
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        (f"{o} x {i}", str(m)) for o, i in linear.SHAPES for m in (1, 17)
    ]
    assert all(float(r[3]) > 0 and float(r[5]) > 0 and float(r[6]) > 0 for r in rows)
