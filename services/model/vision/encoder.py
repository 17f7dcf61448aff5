"""A worker's image encoder: an image's file bytes in, its embeddings out, one image at a
time (an image's bits depend on it alone), the last ones kept by digest so that a repeated
image is encoded once.

    bytes -> open_image (checked) -> Preprocess.pixels -> the family's encoder -> [tokens, C]
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch

from kvstore.block_hash import image_digest
from services.model.families.family import load_symbol
from services.model.vision.images import ImageLimits, open_image
from services.model.vision.shape import VisionShape

CACHED_IMAGES = 64  # embeddings kept per worker (Gemma 3: 256 x 2560 x 2 bytes, 1.3 MB each)
# a worker re-checks what the router checked; these bound it whatever the router allows
WORKER_LIMITS = ImageLimits(max_bytes=64 << 20, max_pixels=64 << 20)


class ImageEncoder:
    """Thread-safe: a worker's request coroutines call it from executor threads."""

    def __init__(
        self,
        vision: VisionShape,
        encode: Callable[[torch.Tensor], torch.Tensor],
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        cached: int = CACHED_IMAGES,
    ) -> None:
        self.vision = vision
        self._encode = encode
        self.width = width  # each row's: the text model's hidden size
        self.dtype = dtype  # the rows' (the model's compute dtype)
        self.device = device
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cached = cached
        self._lock = threading.Lock()  # the cache
        self._tower = threading.Lock()  # one image through the tower at a time
        self.encoded = 0  # images run through the tower
        self.hits = 0  # encode() calls answered from the cache

    def digest(self, data: bytes) -> bytes:
        return image_digest(data, self.vision.preprocess.settings)

    def cached(self, digest: bytes) -> torch.Tensor | None:
        with self._lock:
            found = self._cache.get(digest)
            if found is not None:
                self._cache.move_to_end(digest)
            return found

    def remember(self, digest: bytes, rows: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._cache[digest] = rows
            self._cache.move_to_end(digest)
            while len(self._cache) > self._cached:
                self._cache.popitem(last=False)
        return rows

    def encode(self, data: bytes, digest: bytes | None = None) -> torch.Tensor:
        """The image's rows [tokens_per_image, width]; ImageError for a bad file. `digest`:
        the image's, where the caller has it (else computed here)."""
        key = digest or self.digest(data)
        found = self.cached(key)
        if found is not None:
            self.hits += 1
            return found
        pixels = self.vision.preprocess.pixels(open_image(data, WORKER_LIMITS))
        with self._tower:
            out = self._encode(torch.from_numpy(pixels).to(self.device))
            self.encoded += 1
        return self.remember(key, out)


def build_encoder(
    vision: VisionShape,
    weights: Mapping[str, torch.Tensor],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> ImageEncoder:
    """The family's encoder (VisionShape.encoder) over the checkpoint's weights."""
    family_encoder = load_symbol(vision.encoder)(vision, weights, dtype, device)
    return ImageEncoder(vision, family_encoder, width, dtype, device)
