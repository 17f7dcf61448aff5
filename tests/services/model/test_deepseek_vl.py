"""DeepSeek-VL (services/model/families/deepseek_vl/) against transformers on tiny random
checkpoints (tests/support/tiny_deepseek_vl.py), its text decoder DeepSeek-LLM's Llama shape
or DeepSeek-V3's latent attention and experts: pixels equal to transformers' PIL processor's for
every size, aspect and mode (the longer side resized, centered on a square of the mean's
color); rows equal to get_image_features; greedy tokens equal to transformers' in float32, the
prompt whole or in chunks that end inside an image (its rows attend causally); bfloat16 logits
near transformers' bfloat16 ones; results that do not depend on the batch in every dtype; the
config read; transformers 4's tensor names loaded alike; what is refused, and why."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_vl.image_processing_pil_deepseek_vl import (
    DeepseekVLImageProcessorPil,
)

from services.engine.engine import Engine
from services.engine.images import PromptImage, image_spans, placeholder_runs
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.model.batch import ForwardBatch, ImageRows, SeqChunk
from services.model.errors import ModelLoadError
from services.model.loader import LoadedModel, load_encoder, load_model
from services.model.loading.hf_config import read_config
from services.model.vision.images import ImageLimits, open_image
from services.settings import EngineConfig, SettingsError, build, check
from tests.services.model.test_vision import FILES
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.tiny_deepseek_vl import (
    IMAGE,
    IMAGE_SIZE,
    TEXTS,
    TOKEN_TEXT,
    TOKENS_PER_IMAGE,
    save_tiny_deepseek_vl,
)
from tests.support.tiny_vision import picture

ANY = ImageLimits(max_bytes=1 << 30, max_pixels=1 << 30)
TEXT = (
    "Here is a photograph that I took on my holiday last summer. Describe the picture{image}"
    "and compare it with this one{image}now please tell me what you see in both of them"
)
FIRST, SECOND, THIRD = picture(1, (50, 70)), picture(2, (40, 24), "JPEG"), picture(3, (61, 33))
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", params=TEXTS)
def checkpoint(
    request, tmp_path_factory, embedded_dir
) -> tuple[Path, transformers.PreTrainedModel]:
    """(a tiny checkpoint's directory, transformers' model of it in float32), per decoder."""
    path = tmp_path_factory.mktemp(f"deepseek-vl-{request.param}")
    return path, save_tiny_deepseek_vl(path, embedded_dir, request.param)


@pytest.fixture(scope="module")
def models(checkpoint):
    made: dict[str, LoadedModel] = {}

    def get(dtype: str) -> LoadedModel:
        if dtype not in made:
            made[dtype] = load_model(str(checkpoint[0]), dtype=dtype, device="cpu")
        return made[dtype]

    return get


@pytest.fixture(scope="module")
def loaded(models) -> LoadedModel:
    return models("float32")


@pytest.fixture(scope="module")
def processor(checkpoint) -> DeepseekVLImageProcessorPil:
    return DeepseekVLImageProcessorPil.from_pretrained(str(checkpoint[0]))


@pytest.fixture(scope="module")
def prompt(loaded) -> list[int]:
    image = TOKEN_TEXT[IMAGE] * TOKENS_PER_IMAGE
    return loaded.tokenizer.encode(TEXT.format(image=image))


def reference_pixels(processor, files: Seq[bytes], dtype=torch.float32) -> torch.Tensor:
    """transformers' pixels [N, 3, 32, 32]. Its DeepSeek-VL processor does not convert an
    image to RGB unless asked (a gray or transparent one fails in it): asked here."""
    images = [open_image(f, ANY) for f in files]
    out = processor(images=images, return_tensors="pt", do_convert_rgb=True)
    return out["pixel_values"].to(dtype)


def prompt_images(ids: Seq[int], files: Seq[bytes], loaded: LoadedModel):
    assert loaded.encoder is not None
    digests = [loaded.encoder.digest(f) for f in files]
    spans = image_spans(ids, IMAGE, TOKENS_PER_IMAGE, digests)
    return tuple(
        PromptImage(s, loaded.encoder.encode(f)) for s, f in zip(spans, files, strict=True)
    )


def request(rid: str, ids: Seq[int], files: Seq[bytes], loaded: LoadedModel, params):
    return EngineRequest(rid, list(ids), params, images=prompt_images(ids, files, loaded))


def run(loaded: LoadedModel, *requests: EngineRequest, chunk: int | None = None):
    budget = max(chunk, 64) if chunk else 512
    config = EngineConfig(num_blocks=64, prefill_chunk_size=chunk, max_num_batched_tokens=budget)
    eng = Engine(loaded.model, loaded.tokenizer, config)
    for r in requests:
        eng.add_request(r)
    seqs = [eng.requests[r.request_id].seqs[0] for r in requests]
    while eng.has_unfinished:
        eng.step()
    return seqs


@pytest.mark.parametrize("name", FILES)
def test_pixels_equal_transformers_processor(name, loaded, processor):
    """Whatever the size, aspect (1x1, 20x300, 300x20) or mode, a file decoded by open_image
    becomes exactly the [3, 32, 32] float32 pixels transformers' DeepseekVLImageProcessorPil
    makes of it."""
    assert loaded.encoder is not None
    image = open_image(FILES[name](), ANY)
    ours = loaded.encoder.vision.preprocess.pixels(image)
    theirs = reference_pixels(processor, [FILES[name]()])[0].numpy()
    assert ours.dtype == np.float32 and ours.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    assert np.array_equal(ours, theirs), name


def test_a_long_image_is_padded_with_the_means_color(loaded):
    """A 300 x 20 image: its 14 middle rows of pixels hold it (20 / 300 of 32 rounds to 2;
    min_size is 14), the rest the mean's color in 8 bits, which normalizes to nearly zero."""
    assert loaded.encoder is not None
    pixels = loaded.encoder.vision.preprocess.pixels(open_image(FILES["rgb-300x20"](), ANY))
    top = (IMAGE_SIZE - 14) // 2
    assert np.abs(pixels[:, :top]).max() < 0.02 and np.abs(pixels[:, top + 14 :]).max() < 0.02
    assert np.abs(pixels[:, top : top + 14]).max() > 0.5


@pytest.mark.parametrize("name", ["rgb-70x50", "rgb-17x33", "palette-transparent", "jpeg"])
def test_rows_equal_transformers_image_features(name, loaded, checkpoint, processor):
    """The tower's every patch through the aligner: [16, 64] rows within 1e-5 of
    transformers' get_image_features in float32."""
    assert loaded.encoder is not None
    ours = loaded.encoder.encode(FILES[name]())
    with torch.no_grad():
        pixels = reference_pixels(processor, [FILES[name]()])
        theirs = checkpoint[1].model.get_image_features(pixels).pooler_output[0]
    assert ours.shape == (TOKENS_PER_IMAGE, 64) and ours.dtype == torch.float32
    assert (ours - theirs).abs().max() <= 1e-5, name


@pytest.mark.parametrize("chunk", [512, 7])
def test_greedy_tokens_equal_transformers(chunk, checkpoint, processor, loaded, prompt):
    """Two images of other sizes and formats, 12 tokens, float32: transformers' tokens, the
    prompt whole or in chunks of 7 (which end inside the images: their rows attend as text
    does, so a chunk may)."""
    model = checkpoint[1]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, pixel_values=reference_pixels(processor, [FIRST, SECOND]),
            attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    [seq] = run(loaded, request("a", prompt, [FIRST, SECOND], loaded, GREEDY), chunk=chunk)
    assert seq.output_ids == out[0, len(prompt) :].tolist()


def prompt_logits(loaded: LoadedModel, ids: Seq[int], files: Seq[bytes]) -> torch.Tensor:
    rows = tuple(ImageRows(i.span.start, i.embeds) for i in prompt_images(ids, files, loaded))
    blocks = -(-len(ids) // 16)
    chunk = SeqChunk(list(ids), 0, list(range(blocks)), all_logits=True, images=rows)
    batch = ForwardBatch.build([chunk], 16)
    return loaded.model.forward(batch, loaded.model.new_kv_cache(blocks, 16)).float()


@pytest.mark.parametrize("dtype", [d for d in COMPUTE_DTYPES if d.id == "bfloat16"])
def test_bfloat16_logits_follow_transformers(dtype, checkpoint, processor, models, prompt):
    """In bfloat16 both round differently: the last logits within 2e-2 of their scale of
    transformers' in bfloat16, the same next token."""
    model = transformers.DeepseekVLForConditionalGeneration.from_pretrained(
        str(checkpoint[0]), dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        pixels = reference_pixels(processor, [FIRST, SECOND], torch.bfloat16)
        theirs = model(torch.tensor([prompt]), pixel_values=pixels).logits[0, -1].float()
    ours = prompt_logits(models(dtype), prompt, [FIRST, SECOND])[-1]
    assert (ours - theirs).abs().max() <= 2e-2 * theirs.abs().max() + 2e-2
    assert int(ours.argmax()) == int(theirs.argmax())


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_results_do_not_depend_on_the_batch(dtype, models, prompt):
    """The image request's tokens and logprobs, bit for bit, alone or in one batch with a text
    request before it and another image request after it."""
    loaded = models(dtype)
    if not loaded.model.packed:
        pytest.skip("bitwise guarantees hold for oneDNN's products")
    [alone] = run(loaded, request("a", prompt, [FIRST, SECOND], loaded, LOGPROBS))
    text = loaded.tokenizer.encode("A request of text alone, started with the others")
    [(start, length), _] = placeholder_runs(prompt, IMAGE)
    other = prompt[: start + length + 3] + loaded.tokenizer.encode(" Is it bright?")
    together = run(
        loaded,
        EngineRequest("text", text, LOGPROBS),
        request("a", prompt, [FIRST, SECOND], loaded, LOGPROBS),
        request("other", other, [THIRD], loaded, LOGPROBS),
    )
    assert len(alone.logprobs) == 8
    assert together[1].output_ids == alone.output_ids
    assert together[1].logprobs == alone.logprobs


def test_config_of_the_checkpoint(checkpoint):
    """The text decoder read as its own family reads it (a Llama, or a DeepSeek-V3 with its
    experts); the vision: 16 placeholders an image, no begin or end token, causal, the
    processor's settings, the tower's and the aligner's tensors."""
    config = read_config(checkpoint[0])
    text = checkpoint[1].config.text_config.model_type
    assert config.architecture == text
    assert (config.moe is not None) == (text == "deepseek_v3")
    assert not config.tie_word_embeddings
    vision = config.vision
    assert vision is not None
    assert (vision.image_token_id, vision.tokens_per_image) == (IMAGE, 16)
    assert vision.place_token_id == IMAGE and not vision.bidirectional
    assert vision.expansion(TOKEN_TEXT.__getitem__) == TOKEN_TEXT[IMAGE] * 16
    p = vision.preprocess
    assert (p.height, p.width, p.resample, p.pad, p.min_size) == (32, 32, 3, True, 14)
    tensors = vision.tensor_shapes()
    assert len(tensors) == 5 + 16 * 2 + 4
    assert tensors["aligner.linear1.weight"] == (64, 32)
    assert tensors["vision_model.embeddings.patch_embedding.weight"] == (32, 3, 8, 8)


def test_transformers_4_tensor_names_load_alike(checkpoint, loaded, tmp_path):
    """The checkpoint with its tower under `model.vision_model.vision_model.` (transformers
    4's SiglipVisionModel) and its decoder under `language_model.model.`: the same rows and
    the same logits, bit for bit; an encoder alone reads the same rows."""
    shutil.copytree(checkpoint[0], tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {
        name.replace("model.vision_model.", "model.vision_model.vision_model.").replace(
            "model.language_model.", "language_model.model."
        ): t
        for name, t in tensors.items()
    }
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    other = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.encoder is not None and other.encoder is not None
    rows = loaded.encoder.encode(FIRST)
    assert torch.equal(other.encoder.encode(FIRST), rows)
    alone, _, _ = load_encoder(str(tmp_path), dtype="float32", device="cpu")
    assert torch.equal(alone.encode(FIRST), rows)
    ids = loaded.tokenizer.encode("The tensors keep their values under any name")
    batch = ForwardBatch.build([SeqChunk(ids, 0, [0])], 16)
    logits = [m.model.forward(batch, m.model.new_kv_cache(1, 16)) for m in (loaded, other)]
    assert torch.equal(logits[0], logits[1])


def edited(checkpoint, tmp_path: Path, file: str, change) -> Path:
    shutil.copytree(checkpoint[0], tmp_path, dirs_exist_ok=True)
    raw = json.loads((tmp_path / file).read_text())
    change(raw)
    (tmp_path / file).write_text(json.dumps(raw))
    return tmp_path


def test_what_is_not_served_is_refused_with_the_reason(checkpoint, tmp_path):
    """A text decoder of another kind, a processor size the tower does not read, and tensor
    parallelism (an image's rows stay on one rank) are refused before anything loads."""
    qwen = edited(checkpoint, tmp_path / "a", "config.json",
                  lambda c: c["text_config"].update(model_type="qwen2"))  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"text_config\.model_type 'qwen2'"):
        read_config(qwen)
    size = edited(checkpoint, tmp_path / "b", "preprocessor_config.json",
                  lambda c: c.update(size={"height": 64, "width": 64}))  # fmt: skip
    with pytest.raises(ModelLoadError, match="makes 64x64 images; the vision tower reads 32"):
        read_config(size)
    with pytest.raises(SettingsError, match="a model that reads images runs on one rank"):
        check(build("decode", model=str(checkpoint[0]), tensor_parallel=2))
