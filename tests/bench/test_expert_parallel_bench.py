"""The balancer benchmark's planner table: the figures docs/benchmarks.md quotes (exact, from
eplb.imbalance on seeded Zipf loads)."""

from __future__ import annotations

from bench import expert_parallel


def test_planner_table_figures():
    table = expert_parallel.planner_table()
    assert "| Zipf 1.0 | 8 | 0 | 1.96 | 1.47 | 1.49 (2) |" in table
    assert "| Zipf 1.0 | 64 | 64 | 11.30 | 1.02 | 2.45 (8) |" in table
    assert len(table.splitlines()) == 2 + 8
