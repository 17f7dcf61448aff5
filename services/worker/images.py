"""A request's images on a worker: checked, named and encoded here, never taken on a caller's
word. The worker finds the prompt's image places itself (runs of the model's image token),
names each image by the digest of its bytes and the model's preprocessing (the block hashes
include them), and encodes it (the encoder's cache keeps the last ones), in a thread of its
own: the engine thread keeps stepping the batch meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.block_hash import ImageSpan
from services.engine.images import PromptImage, image_spans
from services.engine.params import ValidationError
from services.model.vision.encoder import ImageEncoder
from services.model.vision.images import ImageError


def spans_of(
    encoder: ImageEncoder | None, prompt: Sequence[int], images: Sequence[bytes]
) -> tuple[ImageSpan, ...]:
    """The prompt's image spans, one per image in order; ValidationError("images") where the
    model reads none or they do not match the prompt's places."""
    if not images:
        return ()
    if encoder is None:
        raise ValidationError("images", "the model reads no images")
    vision = encoder.vision
    digests = [encoder.digest(data) for data in images]
    return image_spans(prompt, vision.image_token_id, vision.tokens_per_image, digests)


async def encode(
    encoder: ImageEncoder | None, spans: Sequence[ImageSpan], images: Sequence[bytes]
) -> tuple[PromptImage, ...]:
    """Each image's embeddings beside its span; ValidationError("images") for a bad file."""
    if not images:
        return ()
    assert encoder is not None  # spans_of refused the request otherwise

    def run() -> list[object]:
        return [encoder.encode(data) for data in images]

    try:
        embeds = await asyncio.to_thread(run)
    except ImageError as e:
        raise ValidationError("images", str(e)) from None
    return tuple(PromptImage(s, e) for s, e in zip(spans, embeds, strict=True))
