"""The block codec: one store value per KV block, safe to read from an untrusted store.

    value = header | scales | payload | mac
    header  fixed 88 bytes, little-endian (FORMAT below)
    scales  fp8 only: float32 [layers, 2] (K, V), the factor each layer's values were divided by
    payload per layer: K [kv_heads, head_dim, block_size] then V [kv_heads, block_size,
            v_head_dim] in the storage dtype (the worker's cache layout,
            services/model/kv_cache.py); a block with no V (a single K row a token, whose
            parts serve as keys and values) has v_head_dim 0
    mac     keyed codecs only (header flag FLAG_MAC): HMAC-SHA256 of everything before it

Decoding checks every header field against what the reader expects (namespace, block hash,
shape, dtype, sizes), the payload against its checksum (xxh3-64) and, with a key, the whole
value against its MAC, and raises CodecError for anything else. Nothing is unpickled,
evaluated or trusted.

What each check protects. The checksum catches damage, not intent: anyone who can write to
the store can also compute xxh3, so without a key a value with a correct header and checksum
but a payload of their choosing is taken as KV. With a key (the deployment's secret, shared
by all its workers: kv_key_file) the MAC covers header, scales and payload, and a value can
only come from a holder of the key. A keyed reader refuses values without a MAC, an unkeyed
reader refuses values with one (mixing them is a misconfiguration, shown as corrupt blocks).
The MAC binds the namespace and block hash (both in the header), so a genuine value cannot be
replayed under another block's key either. The checksum stays beside the MAC: it costs
nothing next to it, and it tells damage ("checksum") from forgery ("MAC") in the reason.

Why HMAC-SHA256 and not keyed BLAKE2b: both are sound MACs; HMAC-SHA256 runs in OpenSSL,
with the SHA extensions every recent x86 and Arm server CPU has, and measured twice as fast
here. Per 368,640-byte block (a bf16 SmolLM2 block), best of 5x300 on this machine (2-core
EPYC with SHA-NI, Python 3.11, OpenSSL 3.0): xxh3-64 5.8 us, HMAC-SHA256 208 us (1.8 GB/s),
keyed BLAKE2b-256 399 us, keyed BLAKE2s 698 us. So a keyed block costs ~0.2 ms more to encode
and to check: ~26 ms per 2,000-token prompt on each side, against ~1.3 s to compute 512
tokens. (The measurement: docs/configuration.md, "The KV store: integrity and access".)
"""

from __future__ import annotations

import enum
import hmac
import math
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvstore.block_hash import HASH_BYTES, KVLayout
from kvstore.keyfile import MIN_KEY_BYTES

MAGIC = b"PDKV"
CODEC_VERSION = 2  # 2: V's head dim in the header (some blocks have no V)
# magic, version, dtype, flags, layers, block_size, num_tokens, kv_heads, head_dim (K's),
# v_head_dim, reserved (4 zero bytes), namespace (16 bytes), block hash (32), payload length
# (scales + payload), checksum of the payload (xxh3-64). Every byte of the header is checked
# on decode.
FORMAT = struct.Struct("<4sHBBHHHHHH4s16s32sQQ")
RESERVED = bytes(4)
FLAG_MAC = 0x01  # the value ends with a MAC_BYTES MAC (keyed codec)
MAC_BYTES = 32  # HMAC-SHA256
FP8_MAX = 448.0  # largest finite float8 e4m3fn


class CodecError(ValueError):
    """A stored value that is not a valid block of the expected kind; `reason` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class StorageDtype(enum.IntEnum):
    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FP8_E4M3 = 3

    @property
    def torch(self) -> torch.dtype:
        return {
            StorageDtype.FLOAT32: torch.float32,
            StorageDtype.FLOAT16: torch.float16,
            StorageDtype.BFLOAT16: torch.bfloat16,
            StorageDtype.FP8_E4M3: torch.float8_e4m3fn,
        }[self]

    @property
    def itemsize(self) -> int:
        return 1 if self is StorageDtype.FP8_E4M3 else torch.empty(0, dtype=self.torch).itemsize

    @classmethod
    def parse(cls, name: str) -> StorageDtype:
        aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "fp8_e4m3"}
        key = aliases.get(name.lower(), name.lower())
        for member in cls:
            if member.name.lower() == key:
                return member
        raise ValueError(f"unknown storage dtype {name!r} (float32, float16, bfloat16, fp8)")


@dataclass(frozen=True)
class DecodedBlocks:
    k: torch.Tensor  # [n, layers, kv_heads, head_dim, block_size]
    v: torch.Tensor  # [n, layers, kv_heads, block_size, v_head_dim]
    num_tokens: list[int]


def mac(key: bytes, data: bytes | memoryview) -> bytes:
    """The MAC of a keyed value: HMAC-SHA256 of its bytes before the MAC."""
    return hmac.digest(key, data, "sha256")


class BlockCodec:
    """Encodes and checks the blocks of one KV layout in one storage dtype; with `key`, every
    value carries a MAC and only values with a valid one are accepted."""

    def __init__(self, layout: KVLayout, dtype: StorageDtype, key: bytes | None = None) -> None:
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a block key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self.layout = layout
        self.dtype = dtype
        self.key = key
        self.flags = FLAG_MAC if key is not None else 0
        self.namespace = bytes.fromhex(layout.namespace())
        self.k_elements = layout.num_kv_heads * layout.head_dim * layout.block_size  # a layer's
        self.v_elements = layout.num_kv_heads * layout.v_dim * layout.block_size
        self.elements = layout.num_layers * (self.k_elements + self.v_elements)
        self.scales_bytes = 8 * layout.num_layers if dtype is StorageDtype.FP8_E4M3 else 0
        self.payload_bytes = self.scales_bytes + self.elements * dtype.itemsize
        self.body_end = FORMAT.size + self.payload_bytes  # where the MAC starts, if any
        self.value_bytes = self.body_end + (MAC_BYTES if key is not None else 0)

    def __repr__(self) -> str:  # never the key
        keyed = "keyed" if self.key is not None else "unkeyed"
        return f"BlockCodec({self.layout}, {self.dtype.name}, {keyed})"

    # -- encode ----------------------------------------------------------------------

    def encode_many(
        self,
        k: torch.Tensor,  # [n, layers, kv_heads, head_dim, block_size]
        v: torch.Tensor,  # [n, layers, kv_heads, block_size, head_dim]
        hashes: Sequence[bytes],
        num_tokens: Sequence[int],
    ) -> list[memoryview]:
        """Values for n blocks, written into one buffer (one view each, no per-block copy)."""
        n, layers = k.shape[0], self.layout.num_layers
        buf = np.empty((n, self.value_bytes), dtype=np.uint8)
        payload = torch.from_numpy(buf[:, FORMAT.size + self.scales_bytes : self.body_end])
        dest = payload.view(self.dtype.torch).view(n, layers, -1)  # [n, L, K then V]
        scales = torch.from_numpy(buf[:, FORMAT.size : FORMAT.size + self.scales_bytes])
        for j, (x, part) in enumerate(zip((k, v), self._parts(dest), strict=True)):
            x = x.flatten(2)  # a view, also for blocks gathered layer-major and transposed
            if self.dtype is StorageDtype.FP8_E4M3:
                scale = torch.ones(n, layers)  # a part with no elements (an absent V) keeps 1
                if x.shape[-1]:
                    scale = (x.abs().amax(dim=-1).float() / FP8_MAX).clamp_min(1e-12)  # [n, L]
                scales.view(torch.float32).view(n, layers, 2)[:, :, j] = scale
                x = (x.float() / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX)
            part.copy_(x)
        views = []
        for i in range(n):
            body = buf[i, FORMAT.size : self.body_end].data  # the row's bytes, no copy
            FORMAT.pack_into(
                buf[i], 0, MAGIC, CODEC_VERSION, int(self.dtype), self.flags, layers,
                self.layout.block_size, num_tokens[i], self.layout.num_kv_heads,
                self.layout.head_dim, self.layout.v_dim, RESERVED, self.namespace, hashes[i],
                self.payload_bytes, xxhash.xxh3_64_intdigest(body),
            )  # fmt: skip
            if self.key is not None:
                tag = mac(self.key, buf[i, : self.body_end].data)
                buf[i, self.body_end :] = np.frombuffer(tag, dtype=np.uint8)
            views.append(buf[i].data)
        return views

    # -- decode ----------------------------------------------------------------------

    def check(self, value: bytes | memoryview, block_hash: bytes) -> int:
        """Validate one value against the expected block; its token count, or CodecError."""
        if len(value) < FORMAT.size:
            raise CodecError(f"truncated: {len(value)} bytes, header alone is {FORMAT.size}")
        fields = FORMAT.unpack_from(value, 0)
        (
            magic,
            version,
            dtype,
            flags,
            layers,
            block_size,
            num_tokens,
            kv_heads,
            head_dim,
            v_dim,
            reserved,
            namespace,
            stored_hash,
            payload_len,
            checksum,
        ) = fields
        lay, keyed = self.layout, bool(flags & FLAG_MAC)
        expect = [
            (magic == MAGIC, "bad magic"),
            (version == CODEC_VERSION, f"codec version {version}, expected {CODEC_VERSION}"),
            (dtype == int(self.dtype), f"dtype {dtype}, expected {int(self.dtype)}"),
            (flags & ~FLAG_MAC == 0 and reserved == RESERVED, "unknown flags"),
            (keyed or self.key is None, "no MAC, and this reader has a key"),
            (not keyed or self.key is not None, "a MAC, and this reader has no key"),
            (layers == lay.num_layers, f"{layers} layers, expected {lay.num_layers}"),
            (block_size == lay.block_size, f"block size {block_size}, expected {lay.block_size}"),
            (kv_heads == lay.num_kv_heads, f"{kv_heads} kv heads, expected {lay.num_kv_heads}"),
            (head_dim == lay.head_dim, f"head dim {head_dim}, expected {lay.head_dim}"),
            (v_dim == lay.v_dim, f"V head dim {v_dim}, expected {lay.v_dim}"),
            (1 <= num_tokens <= lay.block_size, f"token count {num_tokens}"),
            (namespace == self.namespace, "namespace does not match"),
            (stored_hash == block_hash[:HASH_BYTES], "block hash does not match"),
            (payload_len == self.payload_bytes, f"payload length {payload_len}"),
            (len(value) == self.value_bytes, f"size {len(value)}, expected {self.value_bytes}"),
        ]
        for ok, reason in expect:
            if not ok:
                raise CodecError(reason)
        view = memoryview(value)
        if xxhash.xxh3_64_intdigest(view[FORMAT.size : self.body_end]) != checksum:
            raise CodecError("checksum does not match")
        if self.key is not None:
            tag = mac(self.key, view[: self.body_end])
            if not hmac.compare_digest(tag, view[self.body_end :]):
                raise CodecError("MAC does not match: forged, or written with another key")
        if self.scales_bytes:
            scales = np.frombuffer(value, dtype="<f4", count=2 * layers, offset=FORMAT.size)
            if not all(math.isfinite(s) and s > 0 for s in scales.tolist()):
                raise CodecError("fp8 scale is not a positive finite number")
        return int(num_tokens)

    def decode_many(
        self,
        values: Sequence[bytes | memoryview],
        hashes: Sequence[bytes],
        dtype: torch.dtype = torch.float32,
    ) -> DecodedBlocks:
        """Checked values -> K and V in `dtype`. Raises CodecError at the first bad value."""
        counts = [self.check(value, h) for value, h in zip(values, hashes, strict=True)]
        return self.decode_checked(values, counts, dtype)

    def decode_checked(
        self, values: Sequence[bytes | memoryview], counts: list[int], dtype: torch.dtype
    ) -> DecodedBlocks:
        """Values that passed `check` (their token counts given) -> K and V in `dtype`."""
        n, lay = len(values), self.layout
        rows = np.empty((n, self.payload_bytes), dtype=np.uint8)
        for i, value in enumerate(values):
            rows[i] = np.frombuffer(
                value, dtype=np.uint8, count=self.payload_bytes, offset=FORMAT.size
            )
        payload = torch.from_numpy(rows[:, self.scales_bytes :])
        k, v = self._parts(payload.view(self.dtype.torch).view(n, lay.num_layers, -1))
        if self.scales_bytes:
            scales = torch.from_numpy(rows[:, : self.scales_bytes].copy().view("<f4"))
            scales = scales.view(n, lay.num_layers, 2, 1)
            k, v = k.float() * scales[:, :, 0], v.float() * scales[:, :, 1]
        heads, bs = lay.num_kv_heads, lay.block_size
        k = k.to(dtype).reshape(n, lay.num_layers, heads, lay.head_dim, bs)
        v = v.to(dtype).reshape(n, lay.num_layers, heads, bs, lay.v_dim)
        return DecodedBlocks(k, v, counts)

    def _parts(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., layers, K then V elements] -> views of K and of V."""
        return payload[..., : self.k_elements], payload[..., self.k_elements :]

    def decode_into(self, value: bytes | memoryview, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write a checked value into one cache block: k and v views into the cache indexed in
        the stored layout (k [layers, kv_heads, D, bs], v [layers, kv_heads, bs, D], or any
        split of their dimensions: services/model/kv_cache.py's plain views), converting to
        their dtype."""
        layers = self.layout.num_layers
        with warnings.catch_warnings():  # read-only buffer, and we only read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(
                memoryview(value)[FORMAT.size : self.body_end], dtype=torch.uint8
            )
        stored_k, stored_v = self._parts(
            raw[self.scales_bytes :].view(self.dtype.torch).view(layers, -1)
        )
        if self.scales_bytes:
            scales = raw[: self.scales_bytes].view(torch.float32).view(layers, 2, 1)
            stored_k, stored_v = stored_k.float() * scales[:, 0], stored_v.float() * scales[:, 1]
        k.copy_(stored_k.reshape(k.shape))
        v.copy_(stored_v.reshape(v.shape))
