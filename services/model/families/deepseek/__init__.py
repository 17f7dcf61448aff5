"""DeepSeek-V2 and V3: latent attention (mla.py), experts after the first dense layers, and
V3's multi-token-prediction layer (mtp.py). config.py reads their config.json."""

from __future__ import annotations

from services.model.families.deepseek.config import expected_shapes, read_config
from services.model.families.family import Family

FAMILY = Family(
    name="deepseek",
    architectures={"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"},
    read_config=read_config,
    expected_shapes=expected_shapes,
    model="services.model.families.deepseek.model:DeepseekModel",
    mtp="services.model.families.deepseek.mtp",
)
