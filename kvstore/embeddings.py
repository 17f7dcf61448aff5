"""Image embeddings in the store: what an encoder computed for an image, for any worker to
place at the image's tokens (the encoder cache shared by encode, prefill and decode workers).

    key     pdserve:kv:<embeddings namespace>:<first 16 bytes of the image digest, hex>
    value   header | payload | mac
    header  72 bytes, little-endian (FORMAT): magic "PDIE", version, storage dtype, flags,
            rows, width, namespace (16 bytes), the image digest (32 bytes), payload length,
            its xxh3-64
    payload [rows, width] in the storage dtype (the model's compute dtype: the rows go into
            the model as they are)
    mac     keyed codecs only (FLAG_MAC): HMAC-SHA256 of everything before it, with the
            deployment's key (kv_key_file), as for KV blocks

The namespace fingerprints what makes the rows: the workers' KV namespace (the weights), the
compute dtype and the preprocessing, so an encoder of another model or dtype never serves a
worker. Decoding checks every header byte against what the reader expects (the digest it
asked for included) and raises CodecError otherwise: nothing is unpickled or trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import torch
import xxhash

from kvstore.codec import FLAG_MAC, MAC_BYTES, CodecError, StorageDtype, mac
from kvstore.keyfile import MIN_KEY_BYTES

MAGIC = b"PDIE"
VERSION = 1
FORMAT = struct.Struct("<4sHBBII16s32sQQ")


def embeddings_namespace(kv_namespace: str, dtype: str, preprocess: str) -> str:
    """32 hex characters naming the rows an encoder makes for a deployment's workers."""
    text = f"image-embeddings\0{kv_namespace}\0{dtype}\0{preprocess}".encode()
    return hashlib.sha256(text).hexdigest()[:32]


class EmbeddingCodec:
    """Encodes and checks one model's image rows ([rows, width], `dtype`); with `key`, every
    value carries a MAC and only values with a valid one are accepted."""

    def __init__(
        self, namespace: str, dtype: StorageDtype, rows: int, width: int, key: bytes | None
    ) -> None:
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self.namespace = bytes.fromhex(namespace)
        self.dtype, self.rows, self.width, self.key = dtype, rows, width, key
        self.flags = FLAG_MAC if key is not None else 0
        self.payload_bytes = rows * width * dtype.itemsize
        self.body_end = FORMAT.size + self.payload_bytes

    def __repr__(self) -> str:  # never the key
        keyed = "keyed" if self.key is not None else "unkeyed"
        return f"EmbeddingCodec({self.rows}x{self.width}, {self.dtype.name}, {keyed})"

    def encode(self, rows: torch.Tensor, digest: bytes) -> bytes:
        if tuple(rows.shape) != (self.rows, self.width) or rows.dtype != self.dtype.torch:
            raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype}, the codec's differ")
        payload = rows.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        header = FORMAT.pack(
            MAGIC, VERSION, int(self.dtype), self.flags, self.rows, self.width,
            self.namespace, digest, len(payload), xxhash.xxh3_64_intdigest(payload),
        )  # fmt: skip
        body = header + payload
        return body + mac(self.key, body) if self.key is not None else body

    def decode(self, value: bytes | memoryview, digest: bytes) -> torch.Tensor:
        """The rows [rows, width] of the image `digest`; CodecError with the reason."""
        view = memoryview(value)
        want = self.body_end + (MAC_BYTES if self.key is not None else 0)
        if len(view) != want:
            raise CodecError(f"image rows of {len(view)} bytes, expected {want}")
        fields = FORMAT.unpack_from(view, 0)
        expected = (MAGIC, VERSION, int(self.dtype), self.flags, self.rows, self.width,
                    self.namespace, digest, self.payload_bytes)  # fmt: skip
        names = ("magic", "version", "dtype", "flags", "rows", "width", "namespace", "digest",
                 "payload length")  # fmt: skip
        for name, got, expect in zip(names, fields, expected, strict=False):
            if got != expect:
                raise CodecError(f"image rows: {name} {got!r}, expected {expect!r}")
        payload = view[FORMAT.size : self.body_end]
        if xxhash.xxh3_64_intdigest(payload) != fields[-1]:
            raise CodecError("image rows: checksum mismatch")
        if self.key is not None and not hmac.compare_digest(
            mac(self.key, view[: self.body_end]), bytes(view[self.body_end :])
        ):
            raise CodecError("image rows: MAC mismatch")
        flat = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        return flat.view(self.dtype.torch).view(self.rows, self.width)
