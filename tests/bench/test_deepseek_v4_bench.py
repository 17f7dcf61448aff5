"""The DeepSeek-V4 benchmark runs end to end on small contexts and prints its two tables; the
memory table's numbers are the layouts' (V4-Flash: 2 sliding, 21 CSA, 20 HCA layers)."""

from __future__ import annotations

from bench import deepseek_v4


def test_memory_table_from_the_layouts():
    table = deepseek_v4.memory_table()
    # a token's row: 43 x 512 window keys, 21 x 2,560 + 20 x 1,024 inputs, 21 x 160 + 20 x 32
    window, share = (43 * 512 + 21 * 2560 + 20 * 1024) * 2, (21 * 160 + 20 * 32) * 2
    assert f"| DeepSeek-V4-Flash, pdserve now (whole rows) | {window + share:,} |" in table
    released_1k = round((144 * window + 1024 * share) / 1024)
    assert f"| DeepSeek-V4-Flash, window part released | {released_1k:,} |" in table
    assert "| MLA latent (512 + 64), 43 layers | 49,536 |" in table


def test_step_table_smoke(capsys):
    args = ["--dtype", "float32", "--contexts", "256", "--batches", "1,2", "--repeats", "1"]
    assert deepseek_v4.main(args) == 0
    out = capsys.readouterr().out
    for row in ("sliding_attention", "compressed_sparse_attention", "MLA (V3-style latent)"):
        assert f"| {row} |" in out
