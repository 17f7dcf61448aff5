"""A tiny random `DeepseekVLForConditionalGeneration` made with transformers (no hub): a
two-layer SigLIP tower over 32 x 32 images in 8 x 8 patches (16 rows an image), the aligner,
and a text decoder of either kind DeepSeek-VL is built on here: DeepSeek-LLM's Llama shape
(as the shipped 1.3B and 7B) or DeepSeek-V3's latent attention and experts
(tests/support/tiny_models.py's); the embedded tokenizer with `<image_placeholder>` added, a
chat template in DeepSeek-VL's way, and the processor's files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tests.support.tiny_models import BASE, FAMILIES
from tests.support.tiny_vision import write_tokenizer

IMAGE = 49152  # <image_placeholder>
TOKEN_TEXT = {IMAGE: "<image_placeholder>"}
TOKENS_PER_IMAGE = 16
IMAGE_SIZE = 32
TEXTS = ("llama", "deepseek_v3")
SYSTEM = "You are a helpful language and vision assistant."

# DeepSeek-VL's turns: "User: ...\n\nAssistant: ...", an image part its placeholder token
CHAT_TEMPLATE = (
    "{{ '" + SYSTEM + "\\n\\n' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}User: {% else %}Assistant: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image_placeholder>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def text_config(text: str) -> dict:
    """The decoder: tiny_models' Llama-shaped BASE or its DeepSeek-V3, the image token in
    its vocabulary."""
    config = BASE if text == "llama" else FAMILIES["deepseek_v3"]().to_dict()
    return {**config, "model_type": text, "vocab_size": 49160}


def save_tiny_deepseek_vl(
    path: Path, embedded_dir: Path, text: str = "deepseek_v3", seed: int = 0
) -> transformers.PreTrainedModel:
    """The checkpoint at `path`; returns transformers' model of it (float32, eval)."""
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8,
    )  # fmt: skip
    config = transformers.DeepseekVLConfig(
        text_config=text_config(text), vision_config=vision, image_token_id=IMAGE,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.DeepseekVLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # zero biases hide nothing
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path)
    special = {"image_token": TOKEN_TEXT[IMAGE]}
    write_tokenizer(path, embedded_dir, TOKEN_TEXT, CHAT_TEMPLATE, special, "DeepseekVLProcessor")
    processor = {
        "image_processor_type": "DeepseekVLImageProcessor", "do_resize": True,
        "do_rescale": True, "do_normalize": True, "do_pad": True,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "min_size": 14, "resample": 3,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "rescale_factor": 1 / 255,
    }  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    wrapper = {"processor_class": "DeepseekVLProcessor", "num_image_tokens": TOKENS_PER_IMAGE}
    (path / "processor_config.json").write_text(json.dumps(wrapper))
    return model
