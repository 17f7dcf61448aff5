"""Images into Gemma 3 (services/model/vision/, families/gemma3/vision.py), against
transformers on a tiny random `Gemma3ForConditionalGeneration` (tests/support/tiny_vision.py):
files decoded and checked as a worker does, then made into the very pixels transformers' PIL
processor makes, in every size and mode a client may send; the encoder's embeddings as
transformers' (float32), a repeated image served from the cache; the checkpoint's config; the
same checkpoint under transformers 4's tensor names; an encoder loaded alone from its own
tensors; the files `open_image` refuses, and why."""

from __future__ import annotations

import dataclasses
import io
import shutil
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from services.model.batch import ForwardBatch, SeqChunk
from services.model.errors import ModelLoadError
from services.model.loader import LoadedModel, load_encoder, load_model
from services.model.loading.hf_config import read_config
from services.model.vision.images import ImageError, ImageLimits, Preprocess, open_image
from services.model.vision.shape import SiglipShape, VisionShape
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.tiny_vision import BEGIN, END, IMAGE, IMAGE_SIZE, save_tiny_gemma3_vision

ANY = ImageLimits(max_bytes=1 << 30, max_pixels=1 << 30)


def noise(width: int, height: int, channels: int = 3, seed: int = 0) -> Image.Image:
    shape = (height, width, channels) if channels > 1 else (height, width)
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return Image.fromarray(pixels)


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def palette(transparent: bool) -> bytes:
    image = noise(29, 37, seed=7).quantize(16)
    return saved(image, "PNG", transparency=3) if transparent else saved(image, "PNG")


# files as clients send them: (width, height), every mode the processor converts, each format
FILES: dict[str, Callable[[], bytes]] = {
    "rgb-70x50": lambda: saved(noise(70, 50), "PNG"),
    "rgb-17x33": lambda: saved(noise(17, 33, seed=1), "PNG"),
    "rgb-32x32": lambda: saved(noise(32, 32, seed=2), "PNG"),
    "rgb-20x300": lambda: saved(noise(20, 300, seed=3), "PNG"),
    "rgb-300x20": lambda: saved(noise(300, 20, seed=4), "PNG"),
    "rgb-1x1": lambda: saved(noise(1, 1, seed=5), "PNG"),
    "rgba-transparent": lambda: saved(noise(24, 40, channels=4, seed=6), "PNG"),
    "grayscale": lambda: saved(noise(31, 45, channels=1, seed=8), "PNG"),
    "palette": lambda: palette(transparent=False),
    "palette-transparent": lambda: palette(transparent=True),
    "jpeg": lambda: saved(noise(43, 61, seed=9), "JPEG", quality=90),
    "jpeg-grayscale": lambda: saved(noise(64, 20, channels=1, seed=10), "JPEG"),
    "webp": lambda: saved(noise(50, 30, seed=11), "WEBP"),
    "gif": lambda: saved(noise(50, 30, seed=12).quantize(64), "GIF"),
    "bmp": lambda: saved(noise(50, 30, seed=13), "BMP"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_dir):
    """(the tiny checkpoint's directory, transformers' model of it in float32)."""
    path = tmp_path_factory.mktemp("gemma3-vision")
    return path, save_tiny_gemma3_vision(path, embedded_dir)


@pytest.fixture(scope="module")
def loaded(checkpoint) -> LoadedModel:
    return load_model(str(checkpoint[0]), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def processor(checkpoint) -> Gemma3ImageProcessorPil:
    return Gemma3ImageProcessorPil.from_pretrained(str(checkpoint[0]))


def transformers_pixels(processor: Gemma3ImageProcessorPil, image: Image.Image) -> np.ndarray:
    return processor(images=[image], return_tensors="pt")["pixel_values"][0].numpy()


@pytest.mark.parametrize("name", FILES)
def test_pixels_equal_transformers_processor(name, loaded, processor):
    """Whatever the size, aspect or mode (transparency laid over white, palettes, gray, JPEG),
    a file decoded by open_image becomes exactly the [3, 32, 32] float32 pixels transformers'
    Gemma3ImageProcessorPil makes of the same decoded image."""
    assert loaded.encoder is not None
    image = open_image(FILES[name](), ANY)
    ours = loaded.encoder.vision.preprocess.pixels(image)
    theirs = transformers_pixels(processor, image)
    assert ours.dtype == np.float32 and ours.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    assert np.array_equal(ours, theirs), name


def test_transparency_is_laid_over_white_not_dropped(loaded, processor):
    """The RGBA case above is a real test of compositing: its alpha spans 0..255, and
    dropping it (a plain convert("RGB")) gives other pixels than transformers'."""
    assert loaded.encoder is not None
    image = open_image(FILES["rgba-transparent"](), ANY)
    alpha = np.asarray(image)[..., 3]
    assert alpha.min() == 0 and alpha.max() == 255
    dropped = loaded.encoder.vision.preprocess.pixels(image.convert("RGB"))
    assert not np.array_equal(dropped, transformers_pixels(processor, image))


@pytest.mark.parametrize("name", ["rgb-70x50", "rgb-17x33", "palette-transparent", "jpeg"])
def test_embeddings_follow_transformers(name, loaded, checkpoint, processor):
    """The SigLIP tower, pooled, normed and projected: [16, 64] rows within 1e-5 of
    transformers' get_image_features in float32 (on its processor's pixels)."""
    assert loaded.encoder is not None
    data = FILES[name]()
    ours = loaded.encoder.encode(data)
    pixels = torch.from_numpy(transformers_pixels(processor, open_image(data, ANY)))
    with torch.no_grad():
        features = checkpoint[1].model.get_image_features(pixels[None])
    theirs = features.pooler_output[0]
    assert ours.shape == (16, 64) and ours.dtype == torch.float32
    assert (ours - theirs).abs().max() <= 1e-5, name


def test_a_repeated_image_is_served_from_the_cache(loaded):
    """The same file again is a hit: no second run of the tower, the very tensor handed back;
    another file is a miss."""
    encoder = loaded.encoder
    assert encoder is not None
    data = saved(noise(45, 27, seed=20), "PNG")
    first = encoder.encode(data)
    encoded, hits = encoder.encoded, encoder.hits
    again = encoder.encode(data)
    assert again is first
    assert (encoder.encoded, encoder.hits) == (encoded, hits + 1)
    other = encoder.encode(saved(noise(45, 27, seed=21), "PNG"))
    assert (encoder.encoded, encoder.hits) == (encoded + 1, hits + 1)
    assert not torch.equal(other, first)


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_an_images_rows_do_not_depend_on_the_threads(checkpoint, dtype):
    """One image, encoded with 1 and with 2 threads, the same bits: whichever process (an
    encode worker, the prompt's worker) makes an image's rows, the answer is the same."""
    data = saved(noise(60, 44, seed=30), "PNG")
    threads = torch.get_num_threads()
    rows = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            encoder, _, _ = load_encoder(str(checkpoint[0]), dtype, "cpu")  # nothing cached
            rows.append(encoder.encode(data))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(rows[0], rows[1])


def test_config_of_the_checkpoint(checkpoint):
    """config.json with preprocessor_config.json: Gemma 3's text decoder and every field of
    its vision, the processor's settings included."""
    config = read_config(checkpoint[0])
    assert config.architecture == "gemma3"
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (49160, 64, 3)
    assert config.vision is not None
    tensors = config.vision.tensor_shapes()
    assert len(tensors) == 5 + 16 * 2 + 2  # embeddings, norm; 16 a layer; the projector
    assert tensors["multi_modal_projector.mm_input_projection_weight"] == (32, 64)
    assert tensors["vision_tower.encoder.layers.1.mlp.fc1.weight"] == (64, 32)
    assert dataclasses.replace(config.vision, tensors=(), renames=()) == VisionShape(
        image_token_id=IMAGE,
        tokens_per_image=16,
        begin_token_id=BEGIN,
        end_token_id=END,
        around="\n\n",
        preprocess=Preprocess(32, 32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 1 / 255, 2, False, 1),
        tower=SiglipShape(
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=2,
            image_size=32,
            patch_size=4,
            layer_norm_eps=1e-6,
        ),
        encoder="services.model.families.gemma3.vision:Gemma3Encoder",
        weights=("vision_tower.", "multi_modal_projector."),
        bidirectional=True,
    )


# the three parts of a checkpoint as transformers 4.50 and 4.52 to 4.57 save them
STYLES = {
    "transformers-4.50": ("language_model.model.", "vision_tower.vision_model.",
                          "multi_modal_projector."),
    "transformers-4.52": ("model.language_model.", "model.vision_tower.vision_model.",
                          "model.multi_modal_projector."),
}  # fmt: skip
# the parts as the installed transformers saved the fixture's checkpoint
SAVED = ("language_model.model.", "vision_tower.", "multi_modal_projector.")


def restyled(name: str, style: tuple[str, str, str]) -> str:
    for saved_prefix, prefix in zip(SAVED, style, strict=True):
        if name.startswith(saved_prefix):
            return prefix + name.removeprefix(saved_prefix)
    raise AssertionError(f"{name}: a tensor of no known part")


@pytest.mark.parametrize("style", STYLES)
def test_transformers_4_tensor_names_load_alike(style, checkpoint, loaded, tmp_path):
    """The checkpoint with its tensors renamed as transformers 4 saved them: the same
    embeddings and the same logits, bit for bit."""
    copy = tmp_path / style
    shutil.copytree(checkpoint[0], copy)
    tensors = load_file(str(copy / "model.safetensors"))
    renamed = {restyled(name, STYLES[style]): t for name, t in tensors.items()}
    assert set(renamed) != set(tensors)
    save_file(renamed, str(copy / "model.safetensors"), metadata={"format": "pt"})
    other = load_model(str(copy), dtype="float32", device="cpu")
    assert loaded.encoder is not None and other.encoder is not None
    data = FILES["rgb-70x50"]()
    rows = loaded.encoder.encode(data)
    assert torch.equal(other.encoder.encode(data), rows)
    alone, _, _ = load_encoder(str(copy), dtype="float32", device="cpu")
    assert torch.equal(alone.encode(data), rows)
    prompt = loaded.tokenizer.encode("The tensors keep their values under any name")
    batch = ForwardBatch.build([SeqChunk(prompt, 0, [0])], 16)
    logits = [m.model.forward(batch, m.model.new_kv_cache(1, 16)) for m in (loaded, other)]
    assert torch.equal(logits[0], logits[1])


def test_an_encoder_alone_reads_its_own_tensors_alone(checkpoint, loaded, tmp_path):
    """load_encoder (an encode worker's) on a checkpoint holding the tower's and the
    projector's tensors and nothing else: the whole model's embeddings, bit for bit, and the
    width of its rows; the whole model cannot load from it."""
    shutil.copytree(checkpoint[0], tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    kept = {
        n: t
        for n, t in tensors.items()
        if n.startswith(("vision_tower.", "multi_modal_projector."))
    }
    assert 0 < len(kept) < len(tensors)
    save_file(kept, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    encoder, config, _ = load_encoder(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.encoder is not None and encoder.width == config.hidden_size == 64
    data = FILES["jpeg"]()
    assert torch.equal(encoder.encode(data), loaded.encoder.encode(data))
    with pytest.raises(ModelLoadError, match="is missing"):
        load_model(str(tmp_path), dtype="float32", device="cpu")


def resized_header(png: bytes, width: int, height: int) -> bytes:
    """The PNG with the size in its header (IHDR, right after the signature) rewritten."""
    header = struct.pack(">II", width, height) + png[24:29]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    return png[:16] + header + crc + png[33:]


def bilevel(width: int, height: int) -> bytes:
    """A one-color image of `width` x `height` pixels in a few kilobytes."""
    return saved(Image.new("1", (width, height)), "PNG")


def half(data: bytes) -> bytes:
    return data[: len(data) // 2]


MILLION = ImageLimits(max_bytes=1 << 30, max_pixels=1_000_000)
REFUSED = {
    "random-bytes": (lambda: np.random.default_rng(0).bytes(1000), ANY, "not an image"),
    "empty": (lambda: b"", ANY, "not an image"),
    "png-truncated": (lambda: half(FILES["rgb-70x50"]()), ANY, "image file is truncated"),
    "tiff": (lambda: saved(noise(8, 8), "TIFF"), ANY, "format TIFF; send one of PNG"),
    "ico": (lambda: saved(noise(16, 16), "ICO"), ANY, "format ICO"),
    "over-max-bytes": (
        lambda: saved(noise(40, 40), "PNG"),
        ImageLimits(4000, 1 << 30),
        "bytes; at most 4000",
    ),
    "over-max-pixels": (lambda: bilevel(1001, 1000), MILLION, "1001x1000 pixels; at most 1000000"),
    # past Pillow's decompression-bomb limit (89M pixels) whatever an operator allows
    "bomb-10000x10000": (lambda: bilevel(10000, 10000), MILLION, "too many pixels"),
    "bomb-allowed-by-limits": (lambda: bilevel(10000, 10000), ANY, "too many pixels"),
    # Pillow cannot write an image of no pixels: one whose header says so is refused
    "zero-width": (lambda: resized_header(bilevel(20, 10), 0, 10), ANY, "not an image"),
    "zero-height": (lambda: resized_header(bilevel(20, 10), 20, 0), ANY, "not an image"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_open_image_refuses_with_the_reason(name):
    """Each bad file is an ImageError naming why."""
    make, limits, phrase = REFUSED[name]
    with pytest.raises(ImageError, match=phrase):
        open_image(make(), limits)


def test_limits_are_inclusive():
    """A file of exactly max_bytes, an image of exactly max_pixels, is taken (as is a header
    rewritten as the zero-size cases above are, with a size of pixels)."""
    small = saved(noise(40, 40), "PNG")
    assert open_image(small, ImageLimits(len(small), 1600)).size == (40, 40)
    assert open_image(bilevel(1000, 1000), MILLION).size == (1000, 1000)
    assert open_image(resized_header(bilevel(20, 10), 20, 10), ANY).size == (20, 10)


def test_the_pixel_limit_is_read_from_the_header():
    """A PNG cut a few bytes into its pixel data: over the limit, its pixel count is refused
    before any pixel is read; under a higher limit it is refused as truncated."""
    whole = bilevel(2000, 1000)
    cut = whole[: whole.index(b"IDAT") + 14]
    with pytest.raises(ImageError, match="2000x1000 pixels; at most 1000000"):
        open_image(cut, MILLION)
    with pytest.raises(ImageError, match="image file is truncated"):
        open_image(cut, ANY)
