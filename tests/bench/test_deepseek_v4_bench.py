"""The DeepSeek-V4 benchmark runs end to end on small contexts and prints its two tables; the
memory table's numbers are the layouts' (V4-Flash: 2 sliding, 21 CSA, 20 HCA layers)."""

from __future__ import annotations

from bench import deepseek_v4


def test_memory_table_from_the_layouts():
    table = deepseek_v4.memory_table()
    # a token's row: 43 x 512 window keys, 21 x 2,560 + 20 x 1,024 inputs, 21 x 160 + 20 x 32
    window, share = (43 * 512 + 21 * 2560 + 20 * 1024) * 2, (21 * 160 + 20 * 32) * 2
    assert f"| DeepSeek-V4-Flash, every window part kept | {window + share:,} |" in table
    # a pass reads back 127 tokens: 8 window blocks held (128 tokens), at any length
    released = [round((8 * 16 * window + n * share) / n) for n in (1024, 8192, 32768)]
    cells = " | ".join(f"{r:,}" for r in released)
    assert f"| DeepSeek-V4-Flash, pdserve (window blocks released) | {cells} |" in table
    assert "| MLA latent (512 + 64), 43 layers | 49,536 |" in table


def test_step_table_smoke(capsys):
    args = ["--dtype", "float32", "--contexts", "256", "--batches", "1,2", "--repeats", "1"]
    assert deepseek_v4.main(args) == 0
    out = capsys.readouterr().out
    for row in ("sliding_attention", "compressed_sparse_attention", "MLA (V3-style latent)"):
        assert f"| {row} |" in out
