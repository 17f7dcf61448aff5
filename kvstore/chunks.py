"""Chunks' K/V in the store: what approximate KV reuse keeps of a chunk (a document, a chat
message), for any worker of the deployment to place where the chunk next stands
(services/engine/chunk_reuse.py; docs/design.md section 13).

    key     pdserve:kv:<chunk namespace>:<first 16 bytes of the chunk's key, hex>
    value   header | payload | mac
    header  96 bytes, little-endian (FORMAT): magic "PDCK", version, storage dtype, flags,
            layers, heads, K and V dimensions, tokens, the position its first token was
            computed at, namespace (16 bytes), the chunk's key (32 bytes), payload length,
            its xxh3-64
    payload keys [layers, tokens, heads, K dim] then values [layers, tokens, heads, V dim],
            in the storage dtype (the cache's: the rows go into the cache as they are)
    mac     keyed codecs only (FLAG_MAC): HMAC-SHA256 of everything before it, with the
            deployment's key (kv_key_file), as for KV blocks

The chunk's key (chunk_reuse.chunk_key) already holds the workers' KV namespace and the
tenant's salt; the namespace here fingerprints the layout and dtype the rows are in. Decoding
checks every header byte against what the reader expects (the key it asked for and the
chunk's length included) and raises CodecError otherwise: nothing is unpickled or trusted.
The position is the one field the reader cannot know: it is bounded by the model's context.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvstore.codec import FLAG_MAC, MAC_BYTES, CodecError, StorageDtype, mac
from kvstore.keyfile import MIN_KEY_BYTES

MAGIC = b"PDCK"
VERSION = 1
FORMAT = struct.Struct("<4sHBBIIIIII16s32sQQ")


def chunks_namespace(kv_namespace: str, dtype: str) -> str:
    """32 hex characters naming the chunk values a deployment's workers make."""
    return hashlib.sha256(f"chunks\0{kv_namespace}\0{dtype}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class StoredChunk:
    """A chunk's K/V at every layer, keys rotated at the positions it was computed at: what a
    worker's chunk cache holds (services/engine/chunk_reuse.py) and the store keeps."""

    was: int  # the position of its first token where it was computed
    keys: torch.Tensor  # [layers, tokens, heads, K dim]
    values: torch.Tensor  # [layers, tokens, heads, V dim]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class ChunkCodec:
    """Encodes and checks one model's chunk values (its cache's `layers`, `heads`, K and V
    dimensions, `dtype`); with `key`, every value carries a MAC and only values with a valid
    one are accepted. `max_position`: the model's context (a position past it is refused)."""

    def __init__(
        self,
        namespace: str,
        dtype: StorageDtype,
        shape: tuple[int, int, int, int],
        max_position: int,
        key: bytes | None,
    ) -> None:
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        if dtype is StorageDtype.FP8_E4M3:
            raise ValueError("chunks are stored in the cache's dtype, not fp8")
        self.namespace = bytes.fromhex(namespace)
        self.dtype, self.key, self.max_position = dtype, key, max_position
        self.layers, self.heads, self.k_dim, self.v_dim = shape
        self.flags = FLAG_MAC if key is not None else 0

    def __repr__(self) -> str:  # never the key
        keyed = "keyed" if self.key is not None else "unkeyed"
        return f"ChunkCodec({self.layers} layers, {self.dtype.name}, {keyed})"

    def payload_bytes(self, tokens: int) -> int:
        per_token = self.layers * self.heads * (self.k_dim + self.v_dim)
        return tokens * per_token * self.dtype.itemsize

    def encode(self, chunk: StoredChunk, digest: bytes) -> bytes:
        tokens = int(chunk.keys.shape[1])
        want_k = (self.layers, tokens, self.heads, self.k_dim)
        want_v = (self.layers, tokens, self.heads, self.v_dim)
        if tuple(chunk.keys.shape) != want_k or tuple(chunk.values.shape) != want_v:
            raise ValueError(f"chunk K {tuple(chunk.keys.shape)}, V {tuple(chunk.values.shape)}")
        if chunk.keys.dtype != self.dtype.torch or chunk.values.dtype != self.dtype.torch:
            raise ValueError(f"chunk of {chunk.keys.dtype}, the codec's {self.dtype.torch}")
        payload = b"".join(
            t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            for t in (chunk.keys, chunk.values)
        )
        header = FORMAT.pack(
            MAGIC, VERSION, int(self.dtype), self.flags, self.layers, self.heads, self.k_dim,
            self.v_dim, tokens, chunk.was, self.namespace, digest, len(payload),
            xxhash.xxh3_64_intdigest(payload),
        )  # fmt: skip
        body = header + payload
        return body + mac(self.key, body) if self.key is not None else body

    def decode(self, value: bytes | memoryview, digest: bytes, tokens: int) -> StoredChunk:
        """The chunk of `tokens` tokens stored under `digest`; CodecError with the reason."""
        view = memoryview(value)
        payload_bytes = self.payload_bytes(tokens)
        body_end = FORMAT.size + payload_bytes
        want = body_end + (MAC_BYTES if self.key is not None else 0)
        if len(view) != want:
            raise CodecError(f"chunk of {len(view)} bytes, expected {want}")
        fields = FORMAT.unpack_from(view, 0)
        expected = (MAGIC, VERSION, int(self.dtype), self.flags, self.layers, self.heads,
                    self.k_dim, self.v_dim, tokens)  # fmt: skip
        names = ("magic", "version", "dtype", "flags", "layers", "heads", "K dimension",
                 "V dimension", "tokens")  # fmt: skip
        for name, got, expect in zip(names, fields, expected, strict=False):
            if got != expect:
                raise CodecError(f"chunk: {name} {got!r}, expected {expect!r}")
        was, namespace, stored_digest, length, checksum = fields[9:]
        if namespace != self.namespace or stored_digest != digest or length != payload_bytes:
            raise CodecError("chunk: another namespace, chunk or length")
        if was + tokens > self.max_position:
            raise CodecError(f"chunk: computed at {was}, past the model's context")
        payload = view[FORMAT.size : body_end]
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise CodecError("chunk: checksum mismatch")
        if self.key is not None and not hmac.compare_digest(
            mac(self.key, view[:body_end]), bytes(view[body_end:])
        ):
            raise CodecError("chunk: MAC mismatch")
        flat = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        k_bytes = self.layers * tokens * self.heads * self.k_dim * self.dtype.itemsize
        keys = flat[:k_bytes].view(self.dtype.torch)
        values = flat[k_bytes:].view(self.dtype.torch)
        return StoredChunk(
            was,
            keys.view(self.layers, tokens, self.heads, self.k_dim),
            values.view(self.layers, tokens, self.heads, self.v_dim),
        )
