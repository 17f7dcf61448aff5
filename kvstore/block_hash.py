"""Content addresses of KV blocks: the hash chain of docs/design.md, shared by every service.

    h0 = SHA-256(namespace ‖ salt ‖ tokens[0:B])
    hi = SHA-256(h(i-1) ‖ tokens[iB:(i+1)B])
    partial last block (n < B tokens): SHA-256(h(i-1) ‖ tokens ‖ 0xFF ‖ n)
    a block holding some of an image's placeholder tokens: its tokens ‖ 0xFE ‖ the digest of
    each such image (image_digest), in the order they start, before any partial marker

Tokens are little-endian int32, n a little-endian uint32. The marker and the length keep a
partial block's hash from ever equalling a full block's (a full block hashes exactly 4B bytes
after the previous hash; a partial one 4n + 5; with k images, 4B + 1 + 32k and 4n + 6 + 32k:
for n < B no two of these lengths meet). A block's hash names its KV only together with
everything before it, which is what makes prefix reuse safe; an image's digest in every block
its placeholders touch is what keeps two prompts with the same text and different images (the
placeholder tokens alike) from sharing a block.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BLOCK_SIZE = 16  # tokens per KV block, everywhere: part of every block's hash and store key
HASH_BYTES = 32
PARTIAL_MARKER = b"\xff"
IMAGE_MARKER = b"\xfe"


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens in a prompt: `length` tokens from `start`, standing for
    the image whose `digest` (image_digest) names it."""

    start: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.length


def image_digest(data: bytes, settings: str) -> bytes:
    """The name of an image as a model sees it: SHA-256 over its file's bytes and the
    preprocessing settings (size, normalization) that make its embeddings; what the encoder
    cache and the block hashes use."""
    text = settings.encode()
    return hashlib.sha256(b"pdserve-image\0" + struct.pack("<I", len(text)) + text + data).digest()


def _images_in(images: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The marker and digests of the images whose placeholders touch tokens [start, end)."""
    digests = [i.digest for i in images if i.start < end and start < i.end]
    return IMAGE_MARKER + b"".join(digests) if digests else b""


@dataclass(frozen=True)
class KVLayout:
    """Everything that makes KV bytes incompatible between two workers."""

    model_id: str  # fingerprint of the weights
    kv_dtype: str  # the dtype blocks are stored in
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int  # K's (MLA: latent + rotary key)
    v_head_dim: int | None = None  # V's, where it differs from K's (MLA: 0, no V)
    codec_version: int = 2
    # how a token's row is laid out where the model says (DeepSeek-V4's two-pool row); named
    # in the namespace only when set, so every other layout keeps its keys
    row_layout: str | None = None

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def namespace(self) -> str:
        """32 hex characters fingerprinting the layout; part of every block's hash and key."""
        fields = {k: v for k, v in self.__dict__.items() if k != "row_layout" or v is not None}
        text = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(text).hexdigest()[:32]


def _tokens(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    namespace: str,
    salt: bytes = b"",
    include_partial: bool = False,
    images: Sequence[ImageSpan] = (),
) -> list[bytes]:
    """The hash of each full block of `tokens` (and of the trailing partial one if asked)."""
    out = extend_hashes([], tokens, block_size, namespace, salt, images)
    done = len(out) * block_size
    rest = tokens[done:]
    if include_partial and rest:
        prev = out[-1] if out else namespace.encode() + salt
        seen = _images_in(images, done, len(tokens))
        tail = _tokens(rest) + seen + PARTIAL_MARKER + struct.pack("<I", len(rest))
        out.append(hashlib.sha256(prev + tail).digest())
    return out


def extend_hashes(
    hashes: list[bytes],
    tokens: Sequence[int],
    block_size: int,
    namespace: str,
    salt: bytes = b"",
    images: Sequence[ImageSpan] = (),
) -> list[bytes]:
    """Extend `hashes`, the hashes of the first full blocks of `tokens`, to all its full
    blocks, in place; returns it."""
    prev = hashes[-1] if hashes else namespace.encode() + salt
    for i in range(len(hashes), len(tokens) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        block = _tokens(tokens[start:end]) + _images_in(images, start, end)
        prev = hashlib.sha256(prev + block).digest()
        hashes.append(prev)
    return hashes
