"""The offline benchmark runs end to end (tiny sizes) and reports what it measured."""

from __future__ import annotations

import json

from bench import offline


def test_offline_benchmark_smoke(tmp_path, capsys, embedded_dir):
    args = [
        "--model", str(embedded_dir), "--dtype", "float32", "--num-prompts", "3",
        "--min-len", "20", "--max-len", "40", "--output-len", "4", "--kv-cache-gb", "0.3",
        "--skip-transformers", "--json", str(tmp_path / "offline.json"),
    ]  # fmt: skip
    assert offline.main(args) == 0
    out = capsys.readouterr().out
    assert "max 128 sequences, 0.3 GiB of KV, 0 preemptions" in out
    result = json.loads((tmp_path / "offline.json").read_text())
    [ours] = result["results"]
    assert ours["system"] == "pdserve" and ours["output_tokens"] == 3 * 4
    assert ours["prompt_tokens"] == sum(map(len, offline.workload(3, 20, 40)))
    assert result["preemptions"] == 0 and result["decode_overhead"]["batch"] == 32
