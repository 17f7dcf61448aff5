"""Gemma 3's text decoder: local (sliding-window) and global layers, each kind with its own
rope base, q/k norms, GELU MLPs, norms before and after each block (config.py, model.py)."""

from __future__ import annotations

from services.model.families.family import Family
from services.model.families.gemma3.config import expected_shapes, read_config

FAMILY = Family(
    name="gemma3",
    architectures={"Gemma3ForCausalLM": "gemma3_text"},
    read_config=read_config,
    expected_shapes=expected_shapes,
    model="services.model.families.gemma3.model:Gemma3Model",
)
