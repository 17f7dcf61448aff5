"""The forward benchmark runs end to end (tiny sizes) and writes its table, JSON and plot."""

from __future__ import annotations

import json

from bench import forward


def test_forward_benchmark_smoke(tmp_path, capsys, embedded_dir):
    args = [
        "--model", str(embedded_dir), "--dtypes", "float32", "--batches", "1,2",
        "--prompt-len", "20", "--context", "8", "--steps", "2", "--repeats", "1",
        "--json", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "decode.png"),
    ]  # fmt: skip
    assert forward.main(args) == 0
    out = capsys.readouterr().out
    assert "| float32 | prefill 20 |" in out and "| float32 | decode b=2 |" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["work"] for r in rows] == ["prefill 20", "decode b=1", "decode b=2"]
    assert all(r["ours"] > 0 and r["transformers"] > 0 for r in rows)
    assert (tmp_path / "decode.png").read_bytes()[:4] == b"\x89PNG"


def test_markdown_table():
    rows = [forward.Row("float32", "decode b=32", 400.0, 200.0)]
    assert (
        forward.markdown(rows).splitlines()[-1]
        == "| float32 | decode b=32 | 400.0 | 200.0 | 2.00x |"
    )
