"""Images in chat messages, at the edge: each `image_url` part read (a data: URL; a file under
`allowed_local_media_path`; an http(s) URL from `allowed_media_domains`), checked whole with
Pillow against the operator's limits, in order. Anything refused is a 400 naming the part
(`messages.1.content.2.image_url`); no worker sees a request with a bad image.

The chat template writes the image's place token where each image goes (a template reading a
message's parts gets {"type": "image"}; one that reads a string gets the place token's text);
`expand` widens each to the image's run of placeholder tokens before tokenizing, as the
model's processor does (services/model/vision/shape.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from router.completions.protocol import ChatMessage, ImageUrl
from router.errors import bad_request
from services.model.vision.images import ImageError, ImageLimits, open_image
from services.model.vision.shape import VisionShape
from services.settings import RouterSettings
from services.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Place:
    """Where an image part is in the request, for the 400 that names it."""

    param: str
    url: ImageUrl


def places(messages: Sequence[ChatMessage]) -> list[Place]:
    out = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for k, part in enumerate(message.content):
                if part.type == "image_url":
                    out.append(Place(f"messages.{i}.content.{k}.image_url", part.image_url))
    return out


async def read_all(
    settings: RouterSettings, vision: VisionShape | None, messages: Sequence[ChatMessage]
) -> list[bytes]:
    """Every image file of the messages, in order, each checked whole."""
    found = places(messages)
    if not found:
        return []
    if vision is None:
        raise bad_request("the served model reads text; image_url parts are not supported",
                          found[0].param)  # fmt: skip
    if len(found) > settings.max_images_per_request:
        raise bad_request(
            f"{len(found)} images in one request; at most {settings.max_images_per_request}",
            found[settings.max_images_per_request].param,
        )
    limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels)
    files = []
    for place in found:
        data = await read(settings, place)
        try:
            await asyncio.to_thread(open_image, data, limits)
        except ImageError as e:
            raise bad_request(f"{place.param}: {e}", place.param) from None
        files.append(data)
    return files


async def read(settings: RouterSettings, place: Place) -> bytes:
    """An image's file by its URL."""
    url, param = place.url.url, place.param
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return data_url(url, settings.max_image_bytes, param)
    if scheme == "file":
        return local_file(url, settings, param)
    if scheme in ("http", "https"):
        return await remote(url, settings, param)
    raise bad_request(f"{param}: an image URL is a data:, file: or http(s): URL", param)


def data_url(url: str, limit: int, param: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise bad_request(f"{param}: a data URL of an image is base64: data:image/png;base64,...",
                          param)  # fmt: skip
    if len(payload) * 3 // 4 > limit + 3:
        raise bad_request(f"{param}: the image is over {limit} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{param}: not valid base64 ({e})", param) from None


def local_file(url: str, settings: RouterSettings, param: str) -> bytes:
    root = settings.allowed_local_media_path
    if root is None:
        raise bad_request(f"{param}: file URLs are refused (the operator allows a directory "
                          "with --allowed-local-media-path)", param)  # fmt: skip
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise bad_request(f"{param}: a file URL names a local path", param)
    path = Path(os.path.realpath(unquote(parts.path)))
    allowed = Path(os.path.realpath(root))
    if not path.is_relative_to(allowed):
        raise bad_request(f"{param}: {path} is outside the allowed media directory", param)
    try:
        if path.stat().st_size > settings.max_image_bytes:
            raise bad_request(f"{param}: the image is over {settings.max_image_bytes} bytes",
                              param)  # fmt: skip
        return path.read_bytes()
    except OSError as e:
        raise bad_request(f"{param}: cannot read {path.name}: {e.strerror}", param) from None


async def remote(url: str, settings: RouterSettings, param: str) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if host not in {d.lower() for d in settings.allowed_media_domains}:
        raise bad_request(
            f"{param}: remote image URLs are refused ({host or 'no host'} is not among "
            "--allowed-media-domains); send the image as a data: URL",
            param,
        )
    limit = settings.max_image_bytes
    try:
        async with (
            httpx.AsyncClient(timeout=settings.media_fetch_timeout) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise bad_request(f"{param}: fetching it answered {response.status_code}", param)
            data = bytearray()
            async for piece in response.aiter_bytes():
                data += piece
                if len(data) > limit:
                    raise bad_request(f"{param}: the image is over {limit} bytes", param)
            return bytes(data)
    except httpx.HTTPError as e:
        raise bad_request(f"{param}: fetching it failed ({type(e).__name__})", param) from None


def image_text(tokenizer: Tokenizer, vision: VisionShape) -> str | None:
    """What an image is in a template that reads messages as strings (the place token's
    text); None for a template that reads a message's parts (it writes the place token)."""
    template = tokenizer.chat_template
    if template is not None and "image" in template.source:
        return None
    return tokenizer.id_to_token(vision.place_token_id)


def expand(text: str, tokenizer: Tokenizer, vision: VisionShape, images: int) -> str:
    """The rendered prompt with each image's place token widened to its placeholders; 400
    unless the template wrote exactly one place token per image."""
    place = tokenizer.id_to_token(vision.place_token_id)
    written = text.count(place)
    if written != images:
        raise bad_request(
            f"the chat template wrote {written} image places for {images} images", "messages"
        )
    return text.replace(place, vision.expansion(tokenizer.id_to_token))
