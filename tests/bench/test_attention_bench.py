"""The attention benchmark runs end to end (tiny sizes), and its kernel agrees with torch."""

from __future__ import annotations

import pytest

from bench import attention
from services.model import kernels


@pytest.mark.skipif(kernels.load("paged_attention") is None, reason="no C compiler here")
def test_attention_benchmark_smoke(capsys):
    args = ["--batches", "2", "--contexts", "40,17", "--layers", "2", "--rounds", "1"]
    assert attention.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["40", "17"]
    assert all(float(row.split("|")[7]) < 2e-6 for row in rows)  # max diff, float32
