"""The prepared GPU check runs end to end on the CPU in its dry mode (tiny shapes), so that it
cannot rot before a GPU machine runs it: every section recorded, float32 greedy tokens equal
to transformers', the disaggregated stack's text equal to the engine's, its prompt's KV read
by the decode worker from the local:// store."""

from __future__ import annotations

import json

import pytest

from bench import gpu_check
from services.model.loader import cpu_has_bf16_units


def test_dry_run_on_the_cpu(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--dry"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert set(sections) == set(gpu_check.SECTIONS)
    assert all(s["status"] in ("pass", "skip") for s in sections.values()), sections
    kernels = sections["kernel_tests"]["numbers"]
    assert sections["kernel_tests"]["status"] == "pass" and kernels["passed"] == 2
    assert sections["parity"]["status"] == "pass"
    parallel = sections["parallel"]["numbers"]  # over gloo here, NCCL on two GPUs
    assert parallel["backend"] == "gloo" and parallel["tensor_parallel_equal"]
    assert parallel["data_parallel_equal"]
    parity = sections["parity"]["numbers"]
    assert parity["float32"]["identical"] == parity["float32"]["prompts"] == 2
    if not cpu_has_bf16_units():
        assert parity["bfloat16"] == {"skip": "no bf16 units"}
    else:
        assert parity["bfloat16"]["judged"] is False
    served = sections["disaggregated"]["numbers"]
    assert sections["disaggregated"]["status"] == "pass"
    assert served["served_text"] == served["streamed_text"] == served["engine_text"]
    assert served["decode_worker"]["block_hits"] > 0
    assert served["decode_worker"]["recomputed_tokens"] == 0
    assert served["left_running"] == []
    assert not list(tmp_path.glob("kv-*"))  # the store's directory removed
    decode = sections["throughput"]["numbers"]["decode"]
    pdserve = [
        (r["batch"], r["async"], r["deterministic"]) for r in decode if r["system"] == "pdserve"
    ]
    assert sorted(pdserve) == sorted(
        [(b, a, True) for b in (1, 4) for a in ("off", "on")] + [(1, "on", False), (4, "on", False)]
    )
    assert all(r["graph_replays"] is None for r in decode if r["system"] == "pdserve")
    realistic = sections["realistic"]
    assert realistic["status"] == "pass", realistic["reason"]
    models = realistic["numbers"]["models"]
    assert set(models) == {"llama3-8b", "deepseek-v3-2l"}
    gbps = realistic["numbers"]["bandwidth_gb_s"]
    for m in models.values():
        assert list(m["decode_tok_s"]) == ["1", "4"]  # (JSON's keys)
        assert all(t > 0 for t in m["decode_tok_s"].values())
        assert m["limit_tok_s"] == pytest.approx(gbps * 1e9 / m["step_bytes"])
        assert m["prefill"]["tokens"] == 32 and m["prefill"]["ratio"] > 0
    # a step reads every weight but the embedding (49152 x 64), of the MoE layers' routed
    # experts (2 layers x 8 x 3 products of 64 x 32) the 2 of 8 a token uses
    moe = models["deepseek-v3-2l"]
    size = 2 if moe["dtype"] == "torch.bfloat16" else 4
    experts = 2 * 8 * 3 * 64 * 32
    unread = 49152 * 64 + experts * 6 // 8
    assert moe["step_bytes"] == moe["parameter_bytes"] - size * unread
