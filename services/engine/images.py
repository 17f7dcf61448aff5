"""Images in a prompt, as the engine takes them: each image's placeholder tokens (its span:
positions and digest, which every block hash it touches includes) and the embeddings that
take their place. The engine checks them against the model, keeps them with the sequence (a
preempted sequence recomputes its image rows from them) and never splits an image whose rows
attend both ways across two chunks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.block_hash import ImageSpan, image_digest
from services.engine.params import ValidationError


@dataclass(frozen=True)
class PromptImage:
    span: ImageSpan
    # torch.Tensor [span.length, hidden] on the model's device, the model's dtype; None: its
    # rows are being made (an encoder's): the request waits in the queue for them
    # (Engine.add_rows), the other requests go on
    embeds: Any = None


def validate_images(
    images: Sequence[PromptImage], prompt: Sequence[int], vision: Any, hidden: int
) -> None:
    """ValidationError("images") unless the images cover the prompt's runs of placeholder
    tokens one to one, in order, with one embedding row of the model's width per
    placeholder (a prompt without images may hold placeholder tokens: they are tokens)."""
    if not images:
        return
    if vision is None:
        raise ValidationError("images", "the model reads no images")
    end = 0
    for i, image in enumerate(images):
        span = image.span
        shape = None if image.embeds is None else tuple(image.embeds.shape)
        if span.start < end or span.end > len(prompt) or span.length < 1:
            raise ValidationError("images", f"image {i}: positions {span.start}..{span.end}")
        if any(t != vision.image_token_id for t in prompt[span.start : span.end]):
            raise ValidationError("images", f"image {i}: not all placeholder tokens")
        if image.embeds is not None and shape != (span.length, hidden):
            raise ValidationError("images", f"image {i}: embeddings {shape}")
        end = span.end
    runs = placeholder_runs(prompt, vision.image_token_id)
    if [(i.span.start, i.span.length) for i in images] != runs:
        raise ValidationError(
            "images", f"{len(images)} images do not cover the prompt's {len(runs)} image places"
        )


def fit_chunk(images: Sequence[PromptImage], start: int, n: int) -> int:
    """n tokens from `start`, or the nearest count that does not end inside one of `images`
    (images whose rows attend both ways): cut before an image that begins after `start`, else
    run on to its end (past the chunk size: an image is never split)."""
    end = start + n
    for image in images:
        a, b = image.span.start, image.span.end
        if a < end < b:
            return a - start if a > start else b - start
    return n


def placeholder_runs(prompt: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token_id` in the prompt."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*prompt, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def image_spans(
    prompt: Sequence[int], image_token_id: int, tokens_per_image: int, digests: Sequence[bytes]
) -> tuple[ImageSpan, ...]:
    """The spans of a prompt's images, one run of placeholders per image, in order;
    ValidationError("images") when the runs and the images do not match one to one."""
    runs = placeholder_runs(prompt, image_token_id)
    if len(runs) != len(digests):
        raise ValidationError(
            "images", f"{len(digests)} images for {len(runs)} image places in the prompt"
        )
    for start, length in runs:
        if length != tokens_per_image:
            raise ValidationError(
                "images", f"{length} placeholder tokens at {start}; an image takes "
                f"{tokens_per_image}"
            )  # fmt: skip
    return tuple(ImageSpan(s, n, d) for (s, n), d in zip(runs, digests, strict=True))


def spans_of_files(
    prompt: Sequence[int], vision: Any, files: Sequence[bytes]
) -> tuple[ImageSpan, ...]:
    """image_spans with each file named as every process names it (its digest with the
    model's preprocessing: the router, the workers)."""
    digests = [image_digest(data, vision.preprocess.settings) for data in files]
    return image_spans(prompt, vision.image_token_id, vision.tokens_per_image, digests)
