"""DeepSeek-V4: hyper-connected residual streams, attention over a sliding window of one
shared K=V head plus compressed entries (a lightning indexer picking among them), experts
routed by hash or by score, FP8/FP4 weights, and its MTP layer (config.py, model.py,
attention.py, rows.py, quant.py, mtp.py; docs/deepseek-v4.md)."""

from __future__ import annotations

from services.model.families.deepseek_v4.config import read_config
from services.model.families.deepseek_v4.names import canonical_name, expected_shapes
from services.model.families.family import Family


def _scale(name: str) -> str:
    """An FP8 weight's scales: DeepSeek's `<name>.scale`."""
    return name.removesuffix(".weight") + ".scale"


FAMILY = Family(
    name="deepseek_v4",
    architectures={"DeepseekV4ForCausalLM": "deepseek_v4"},
    read_config=read_config,
    expected_shapes=expected_shapes,
    model="services.model.families.deepseek_v4.model:DeepseekV4Model",
    stored_name=canonical_name,
    own_scales=_scale,
    mtp="services.model.families.deepseek_v4.mtp",
    tensor="services.model.families.deepseek_v4.tensor",
)
