"""A tiny random `Gemma3ForConditionalGeneration` made with transformers (no hub): Gemma 3's
text decoder of tiny_models' size, a two-layer SigLIP tower over 32 x 32 images in 4 x 4
patches (64), pooled to 16 rows an image; the embedded tokenizer with Gemma 3's three image
tokens added, a chat template that places images as Gemma 3's does, and a
preprocessor_config.json."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

BEGIN, END, IMAGE = 49152, 49153, 49154  # <start_of_image>, <end_of_image>, <image_soft_token>
TOKEN_TEXT = {BEGIN: "<start_of_image>", END: "<end_of_image>", IMAGE: "<image_soft_token>"}
TOKENS_PER_IMAGE = 16
IMAGE_SIZE = 32

# Gemma 3's way with a message's parts: an image part is its begin token, text parts trimmed
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vision_config() -> transformers.Gemma3Config:
    text = dict(
        vocab_size=49160, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=16, final_logit_softcapping=30.0, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=4, vision_use_head=False,
    )  # fmt: skip
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BEGIN, eoi_token_index=END, image_token_index=IMAGE,
    )  # fmt: skip


def save_tiny_gemma3_vision(
    path: Path, embedded_dir: Path, seed: int = 0, config: transformers.Gemma3Config | None = None
):
    """The checkpoint at `path` (`config`: another size, bench/images.py's); returns
    transformers' model (float32, eval)."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config or vision_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "mm_input_projection_weight")):
                p.normal_(0, 0.5)  # (1 + weight) norms and zero projections hide nothing
    model.save_pretrained(path)
    special = {"boi_token": TOKEN_TEXT[BEGIN], "eoi_token": TOKEN_TEXT[END],
               "image_token": TOKEN_TEXT[IMAGE]}  # fmt: skip
    write_tokenizer(path, embedded_dir, TOKEN_TEXT, CHAT_TEMPLATE, special, "Gemma3Processor")
    side = model.config.vision_config.image_size
    processor = {
        "image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "do_rescale": True,
        "do_normalize": True, "size": {"height": side, "width": side},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255, "resample": 2, "do_pan_and_scan": False,
    }  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    tokens = model.config.mm_tokens_per_image
    wrapper = {"processor_class": "Gemma3Processor", "image_seq_length": tokens}
    (path / "processor_config.json").write_text(json.dumps(wrapper))
    return model


def write_tokenizer(
    path: Path,
    embedded_dir: Path,
    tokens: dict[int, str],
    template: str,
    special: dict[str, str],
    processor_class: str,
) -> None:
    """The embedded tokenizer with the image `tokens` added, the chat `template`, and the
    `special` tokens the model's processor reads (transformers' AutoProcessor, vLLM)."""
    tokenizer = json.loads((embedded_dir / "tokenizer.json").read_text())
    for token_id, text in tokens.items():
        flags = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized"), False)
        token = {"id": token_id, "content": text, "special": True, **flags}
        tokenizer["added_tokens"].append(token)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((embedded_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template  # (it wins over chat_template.jinja)
    config["extra_special_tokens"] = special
    config["processor_class"] = processor_class
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(template)


def picture(seed: int, size: tuple[int, int] = (20, 30), fmt: str = "PNG") -> bytes:
    """A file of random pixels, `size` (height, width), in `fmt`."""
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()
