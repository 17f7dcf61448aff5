"""DeepSeek-VL (`DeepseekVLForConditionalGeneration`): a SigLIP tower whose every patch is one
image row, through the aligner (Linear, GELU, Linear) to the text width, in place of the
image's placeholders, which attend as text does (causally). The text decoder is another
family's, read as that family reads it: DeepSeek-LLM's Llama shape as DeepSeek ships the model,
or DeepSeek-V2/V3's latent attention and experts (transformers builds whatever `text_config`
names). Pixels as transformers' DeepseekVLImageProcessor makes them: the longer side to the
tower's size (384), centered on a square of the mean's color.

    <image_placeholder>  ->  <image_placeholder> x (image_size / patch_size)^2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.vision.images import Preprocess, read_preprocess
from services.model.vision.shape import SiglipShape, VisionShape

TEXT_TYPES = ("llama", "deepseek_v2", "deepseek_v3")  # decoders whose model takes image rows
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the processor's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3

# checkpoint names as transformers saves them -> the names the models read
RENAMES = (
    (r"^(model\.)?language_model\.(model\.)?", "model."),
    (r"^model\.vision_model\.(vision_model\.)?", "vision_model."),
    (r"^model\.aligner\.", "aligner."),
)


def read_config(
    raw: dict[str, Any], read_text: Callable[[dict[str, Any]], ModelConfig]
) -> ModelConfig:
    """The text decoder's config (`read_text` reads text_config as its family does) with the
    vision tower, aligner and preprocessing attached."""
    text = dict(raw.get("text_config") or {})
    text_type = text.get("model_type", "llama")
    if text_type not in TEXT_TYPES:
        raise ModelLoadError(
            "config.json", f"text_config.model_type {text_type!r}: DeepSeek-VL is served over "
            f"{', '.join(TEXT_TYPES)}"
        )  # fmt: skip
    text = {k: v for k, v in text.items() if k != "architectures"} | {"model_type": text_type}
    for key in ("eos_token_id", "_name_or_path"):
        if key in raw:
            text[key] = raw[key]
    # the outer config's tying wins (transformers ties lm_head by it)
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))
    config = read_text(text)
    tower = read_tower(raw.get("vision_config") or {})
    default = Preprocess(
        tower.image_size, tower.image_size, CLIP_MEAN, CLIP_STD, resample=BICUBIC, pad=True,
        min_size=14,
    )  # fmt: skip
    preprocess = read_preprocess(raw.get("_preprocessor") or {}, default)
    if (preprocess.height, preprocess.width) != (tower.image_size,) * 2:
        raise ModelLoadError(
            "config.json", f"preprocessor_config.json makes {preprocess.height}x"
            f"{preprocess.width} images; the vision tower reads {tower.image_size}"
        )  # fmt: skip
    c, v = config.hidden_size, tower.hidden_size
    aligner = {"aligner.linear1.weight": (c, v), "aligner.linear1.bias": (c,),
               "aligner.linear2.weight": (c, c), "aligner.linear2.bias": (c,)}  # fmt: skip
    vision = VisionShape(
        image_token_id=int(raw.get("image_token_id", 100015)),
        tokens_per_image=tower.patches_per_side**2,
        preprocess=preprocess,
        tower=tower,
        encoder="services.model.families.deepseek_vl.vision:DeepseekVLEncoder",
        weights=("vision_model.", "aligner."),
        tensors=tuple((tower.tensor_shapes("vision_model.") | aligner).items()),
        renames=RENAMES,
    )
    return dataclasses.replace(config, vision=vision)


def read_tower(v: dict[str, Any]) -> SiglipShape:
    """vision_config: a SigLIP vision model (transformers' defaults for missing fields); its
    attention-pooling head, if any, is not read (DeepSeek-VL takes every patch)."""
    kind = v.get("model_type", "siglip_vision_model")
    if kind != "siglip_vision_model":
        raise ModelLoadError("config.json", f"vision_config.model_type {kind!r}: a SigLIP tower")
    if v.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError("config.json", f"unsupported vision hidden_act {v['hidden_act']!r}")
    return SiglipShape(
        hidden_size=int(v.get("hidden_size", 768)),
        intermediate_size=int(v.get("intermediate_size", 3072)),
        num_layers=int(v.get("num_hidden_layers", 12)),
        num_heads=int(v.get("num_attention_heads", 12)),
        image_size=int(v.get("image_size", 224)),
        patch_size=int(v.get("patch_size", 16)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
    )
