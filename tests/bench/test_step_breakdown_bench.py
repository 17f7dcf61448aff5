"""bench/step_breakdown.py on a tiny DeepSeek-V3: every part timed, the parts summing to the
step (exclusive times), for decode and for prompts."""

from __future__ import annotations

import pytest

from bench import step_breakdown
from tests.support.tiny_models import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("deepseek")
    save_tiny("deepseek_v3", path, embedded_dir)
    return path


def _check(ms: dict[str, float]) -> None:
    assert set(ms) == {*step_breakdown.PARTS, "step"}
    for part in ("MLA projections", "routing", "expert products", "logits", "serving loop"):
        assert ms[part] > 0, part
    parts = sum(ms[p] for p in step_breakdown.PARTS)
    # the parts are what the step spent; the rest is the loop's own few Python lines
    assert parts <= ms["step"] * 1.01 and parts >= ms["step"] * 0.9


def test_decode_parts_sum_to_the_step(tiny):
    _check(step_breakdown.breakdown(tiny, "float32", batch=3, context=20, steps=3))


def test_prompt_parts_sum_to_the_whole(tiny, capsys):
    ms = step_breakdown.prefill_breakdown(tiny, "float32", prompts=2, length=40)
    _check(ms)
    text = step_breakdown.table({2: ms})
    assert text.splitlines()[-1].startswith("| step | ")
