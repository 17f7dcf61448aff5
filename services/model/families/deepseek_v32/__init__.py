"""DeepSeek-V3.2: DeepSeek-V3 with a lightning indexer in every layer choosing which earlier
tokens each query attends to (config.py, model.py)."""

from __future__ import annotations

from services.model.families.deepseek_v32.config import expected_shapes, read_config
from services.model.families.family import Family

FAMILY = Family(
    name="deepseek_v32",
    architectures={"DeepseekV32ForCausalLM": "deepseek_v32"},
    read_config=read_config,
    expected_shapes=expected_shapes,
    model="services.model.families.deepseek_v32.model:DeepseekV32Model",
    tensor="services.model.families.deepseek_v32.tensor",
)
