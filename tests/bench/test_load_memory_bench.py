"""bench/load_memory.py: a fresh process loads the model as it is asked (whole, a share of the
experts) and reports its peaks."""

from __future__ import annotations

from bench import load_memory
from services.model.loading import hf_config


def test_a_process_builds_its_share_of_the_experts(tiny_dir):
    path = tiny_dir("qwen3_moe")
    layers = len(hf_config.read_config(path).moe.layers)  # type: ignore[union-attr]
    whole, half = load_memory.load(path, "float32"), load_memory.load(path, "float32", owners=2)
    assert (whole["experts"], half["experts"]) == (8 * layers, 4 * layers)
    assert whole["after"] >= whole["before"] > 0
