"""bench/vllm_breakdown.py's reading of a vLLM profiler trace: self times (a parent less its
children), steps counted, operators into step_breakdown's parts (oneDNN products by their
output's width). On a small trace written here in the profiler's format."""

from __future__ import annotations

import pytest

from bench import step_breakdown, vllm_breakdown

SHAPE = {**step_breakdown.SHAPE, "num_attention_heads": 16}


def _op(name: str, ts: float, dur: float, dims: list[list[int]] | None = None) -> dict:
    args = {} if dims is None else {"Input Dims": dims}
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1,
            "tid": 2, "args": args}  # fmt: skip


def _trace() -> dict:
    step = "execute_context_0(0)_generation_32(32)"
    events = []
    for start in (0.0, 1000.0):  # two steps of 1 ms
        events += [
            _op(step, start, 1000.0),
            _op("_C::onednn_mm", start + 10, 100.0, [[32, 1088], [32, 1024], [], []]),
            _op("_C::onednn_mm", start + 120, 50.0, [[32, 1024], [32, 2048], [], []]),
            _op("_C::onednn_mm", start + 180, 40.0, [[32, 1024], [32, 384], [], []]),
            _op("_C::onednn_mm", start + 230, 200.0, [[32, 49152], [32, 1024], [], []]),
            _op("vllm::unified_mla_attention_with_output", start + 440, 300.0),
            _op("_C::mla_decode_kvcache", start + 450, 250.0),
            _op("_C::cpu_fused_moe", start + 750, 150.0),
            _op("aten::copy_", start + 910, 20.0),
        ]
    # the async front end's thread: less busy, not the worker's
    events.append({**_op("AsyncLLM.generate", 0.0, 300.0), "tid": 9})
    return {"traceEvents": events}


def test_self_times_take_the_children_out_of_their_parents():
    events = vllm_breakdown.self_times(_trace())
    assert vllm_breakdown.steps_in(events) == 2
    own = {name: t for name, _, t in events[:9]}
    assert (
        own["execute_context_0(0)_generation_32(32)"] == 1000 - 100 - 50 - 40 - 200 - 300 - 150 - 20
    )
    assert own["vllm::unified_mla_attention_with_output"] == 50
    assert all(name != "AsyncLLM.generate" for name, _, _ in events)


def test_operators_land_in_their_parts():
    ms = vllm_breakdown.breakdown(_trace(), SHAPE)
    assert ms["MLA projections"] == pytest.approx(0.1)
    assert ms["attention output"] == pytest.approx(0.05)  # out 1024 from 16 x 128
    assert ms["dense MLPs"] == pytest.approx(0.04)  # out 1024 from 384: a down product
    assert ms["logits"] == pytest.approx(0.2)
    assert ms["MLA attention"] == pytest.approx(0.3)  # the kernel and its wrapper's own time
    assert ms["expert products"] == pytest.approx(0.15)
    assert ms["forward, rest"] == pytest.approx(0.02)
    assert ms["serving loop"] == pytest.approx(0.14)
    assert ms["step"] == pytest.approx(1.0)
