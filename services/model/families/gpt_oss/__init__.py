"""gpt-oss: grouped-query attention with a learned sink per head, sliding-window and full
layers alternating, experts in every layer (config.py, model.py)."""

from __future__ import annotations

from services.model.families.family import Family
from services.model.families.gpt_oss.config import expected_shapes, read_config

FAMILY = Family(
    name="gpt_oss",
    architectures={"GptOssForCausalLM": "gpt_oss"},
    read_config=read_config,
    expected_shapes=expected_shapes,
    model="services.model.families.gpt_oss.model:GptOssModel",
)
