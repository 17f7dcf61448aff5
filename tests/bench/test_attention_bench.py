"""The attention benchmark runs end to end (tiny sizes), and its kernel agrees with torch."""

from __future__ import annotations

import pytest

from bench import attention
from services.model import kernels


@pytest.mark.skipif(kernels.load("paged_attention") is None, reason="no C compiler here")
def test_attention_benchmark_smoke(capsys):
    args = ["--batches", "2", "--contexts", "40,17", "--layers", "2", "--rounds", "1",
            "--chunks", "0+20,33+7"]  # fmt: skip
    assert attention.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| 2 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["40", "17"]
    assert all(float(row.split("|")[7]) < 2e-6 for row in rows)  # max diff, float32
    prefill = [line.split("|") for line in lines if line.startswith(("| 0 | 20 |", "| 33 | 7 |"))]
    assert len(prefill) == 2
    assert all(float(row[7]) < 4e-6 for row in prefill)
