"""The disaggregation benchmark runs end to end (a tiny DeepSeek-V3, short prompts): workers,
the stall and TTFT measurements, its JSON and plot."""

from __future__ import annotations

import json

from bench import disagg
from tests.support.tiny_models import save_tiny


def test_disagg_benchmark_smoke(tmp_path, embedded_dir):
    model = tmp_path / "deepseek"
    save_tiny("deepseek_v3", model, embedded_dir)
    out = tmp_path / "result.json"
    # the streams (cancelled once the prompt's first token is out) must outlast the warm-up
    # and the join on a fast CPU too: the most tokens the model's 512 positions allow
    args = ["--model", str(model), "--dtype", "float32", "--streams", "2", "--prompt-len", "80",
            "--stream-tokens", "470", "--warmup", "0.3", "--repeats", "1",
            "--json", str(out), "--plot", str(tmp_path / "stall.png")]  # fmt: skip
    assert disagg.main(args) == 0
    result = json.loads(out.read_text())
    assert result["ttft"]["hit_ms"] > 0 and result["ttft"]["uncached_ms"] > 0
    assert result["stall"]["median_gap_ms"] > 0
    assert (tmp_path / "stall.png").read_bytes()[:4] == b"\x89PNG"
