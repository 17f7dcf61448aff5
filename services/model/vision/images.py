"""Images in: a file's bytes checked and decoded (Pillow), then resized and normalized as a
model's processor does, into the pixels its vision tower reads. No torch: the router checks
images with `open_image` before any worker sees them.

The pixels equal transformers' PIL image processors' (tests/services/model/test_vision.py):
RGB with transparency laid over white, Pillow's resampling on 8-bit pixels, times the rescale
factor in float64, then (x - mean) / std in float32.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

# formats a client sends (OpenAI's list, and BMP); anything else Pillow opens is refused
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


class ImageError(ValueError):
    """An image refused: not an image, a format not taken, truncated, or past a limit."""


@dataclass(frozen=True)
class ImageLimits:
    """What an operator allows per image (router settings: max_image_bytes, max_image_pixels)."""

    max_bytes: int
    max_pixels: int


def open_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """The decoded image, every pixel read (a truncated file fails here, not in a worker);
    ImageError with the reason. The pixel count is checked from the header, before any pixel
    is decoded, so a decompression bomb costs nothing."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"{len(data)} bytes; at most {limits.max_bytes} per image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise ImageError(f"format {image.format}; send one of {', '.join(FORMATS)}")
            width, height = image.size
            if width * height > limits.max_pixels:
                raise ImageError(f"{width}x{height} pixels; at most {limits.max_pixels} per image")
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"too many pixels: {e}") from None
    except Image.UnidentifiedImageError:
        raise ImageError("not an image (no format Pillow reads)") from None
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError... on bad files
        raise ImageError(f"not a readable image ({type(e).__name__}: {e})") from None
    if width < 1 or height < 1:
        raise ImageError("an image with no pixels")
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited over white (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class Preprocess:
    """How a model's processor turns an image into pixels: one fixed size, reached by
    squashing the image to it (Gemma 3's 896 x 896) or, with `pad`, by resizing its longer
    side to it (the shorter at least `min_size`) and centering it on a square of the mean's
    color (DeepSeek-VL's 384); Pillow's resampling filter, rescale, per-channel mean and std."""

    height: int
    width: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255
    resample: int = 2  # PIL's numbering (RESAMPLE): bilinear
    pad: bool = False
    min_size: int = 1

    @property
    def settings(self) -> str:
        """These settings as canonical JSON: part of every image's digest (an image made into
        other pixels is another image to the cache)."""
        return json.dumps(self.__dict__, sort_keys=True)

    def pixels(self, image: Image.Image) -> np.ndarray:  # [3, height, width] float32
        rgb = to_rgb(image)
        sized = self._padded(rgb) if self.pad else self._resized(rgb, self.width, self.height)
        x = (sized.astype(np.float64) * self.rescale).astype(np.float32)
        mean, std = np.array(self.mean, np.float32), np.array(self.std, np.float32)
        return np.ascontiguousarray(((x - mean) / std).transpose(2, 0, 1))

    def _resized(self, rgb: Image.Image, width: int, height: int) -> np.ndarray:
        return np.asarray(rgb.resize((width, height), resample=Image.Resampling(self.resample)))

    def _padded(self, rgb: Image.Image) -> np.ndarray:  # [side, side, 3] uint8
        width, height = rgb.size
        scale = self.height / max(width, height)
        new_h = max(round(height * scale), self.min_size)
        new_w = max(round(width * scale), self.min_size)
        resized = self._resized(rgb, new_w, new_h)
        if new_h == new_w:
            return resized
        side = max(new_h, new_w)
        square = np.empty((side, side, 3), np.uint8)
        square[:] = [int(m * 255) for m in self.mean]
        if new_w > new_h:
            top = (side - new_h) // 2
            square[top : top + new_h] = resized
        else:
            left = (side - new_w) // 2
            square[:, left : left + new_w] = resized
        return square


def read_preprocess(raw: dict[str, Any], defaults: Preprocess) -> Preprocess:
    """A processor's preprocessor_config.json (a dict; {} where the checkpoint has none), its
    missing fields the model's processor's `defaults`."""
    size = raw.get("size") or {}
    height = int(size.get("height") or defaults.height)
    width = int(size.get("width") or defaults.width)
    resample = int(raw.get("resample", defaults.resample))
    if resample not in RESAMPLE:
        raise ValueError(f"preprocessor_config.json: resample {resample} (one of 0-5)")
    if raw.get("do_pan_and_scan"):
        raise ValueError("preprocessor_config.json: do_pan_and_scan is not served")
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if raw.get(flag) is False:
            raise ValueError(f"preprocessor_config.json: {flag}=false is not served")
    mean = tuple(float(v) for v in raw.get("image_mean") or defaults.mean)
    std = tuple(float(v) for v in raw.get("image_std") or defaults.std)
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError("preprocessor_config.json: image_mean and image_std of 3 channels")
    rescale = float(raw.get("rescale_factor") or defaults.rescale)
    pad = bool(raw.get("do_pad", defaults.pad))
    if pad and height != width:
        raise ValueError(f"preprocessor_config.json: do_pad onto a square, not {height}x{width}")
    min_size = int(raw.get("min_size") or defaults.min_size)
    return Preprocess(height, width, mean, std, rescale, resample, pad, min_size)
