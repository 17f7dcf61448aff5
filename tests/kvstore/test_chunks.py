"""Chunks' K/V as the store holds them (kvstore/chunks.py): byte-identical round trips in
each cache dtype and for a latent cache (no V); every header field, the payload and the MAC
checked, each corruption refused with its reason."""

from __future__ import annotations

import pytest
import torch

from kvstore.chunks import FORMAT, ChunkCodec, StoredChunk, chunks_namespace
from kvstore.codec import MAC_BYTES, CodecError, StorageDtype

DIGEST = bytes(range(32))
NAMESPACE = chunks_namespace("kv-namespace", "bfloat16")
KEY = b"k" * 32


def chunk(shape, dtype: torch.dtype, tokens: int = 19, was: int = 40) -> StoredChunk:
    layers, heads, k_dim, v_dim = shape
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(layers, tokens, heads, k_dim, generator=g).to(dtype)
    values = torch.randn(layers, tokens, heads, v_dim, generator=g).to(dtype)
    return StoredChunk(was, keys, values)


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (StorageDtype.FLOAT32, (3, 2, 8, 8)),
        (StorageDtype.BFLOAT16, (3, 2, 8, 8)),
        (StorageDtype.BFLOAT16, (2, 1, 24, 0)),  # a latent row, no V
    ],
)
@pytest.mark.parametrize("key", [None, KEY])
def test_round_trips_are_byte_identical(dtype, shape, key):
    codec = ChunkCodec(NAMESPACE, dtype, shape, 4096, key)
    stored = chunk(shape, dtype.torch)
    value = codec.encode(stored, DIGEST)
    assert len(value) == FORMAT.size + codec.payload_bytes(19) + (MAC_BYTES if key else 0)
    back = codec.decode(value, DIGEST, 19)
    assert back.was == 40
    for a, b in ((back.keys, stored.keys), (back.values, stored.values)):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_what_is_refused():
    shape = (3, 2, 8, 8)
    codec = ChunkCodec(NAMESPACE, StorageDtype.FLOAT32, shape, 50, KEY)
    value = codec.encode(chunk(shape, torch.float32, was=20), DIGEST)

    def refused(data: bytes, match: str, digest: bytes = DIGEST, tokens: int = 19) -> None:
        with pytest.raises(CodecError, match=match):
            codec.decode(data, digest, tokens)

    refused(value[:-1], "bytes, expected")
    refused(value, "bytes, expected", tokens=18)  # another chunk's length
    refused(b"XXXX" + value[4:], "magic")
    refused(value, "another namespace, chunk", digest=bytes(32))
    heads = 12  # the heads field's offset: magic 4, version 2, dtype 1, flags 1, layers 4
    refused(value[:heads] + b"\x03" + value[heads + 1 :], "heads")
    flipped = bytearray(value)
    flipped[FORMAT.size + 5] ^= 1
    refused(bytes(flipped), "checksum")
    other = ChunkCodec(NAMESPACE, StorageDtype.FLOAT32, shape, 50, b"o" * 32)
    with pytest.raises(CodecError, match="MAC"):
        other.decode(value, DIGEST, 19)
    unkeyed = ChunkCodec(NAMESPACE, StorageDtype.FLOAT32, shape, 50, None)
    with pytest.raises(CodecError, match="bytes, expected"):  # no MAC where one is wanted
        codec.decode(unkeyed.encode(chunk(shape, torch.float32), DIGEST), DIGEST, 19)
    far = codec.encode(chunk(shape, torch.float32, was=40), DIGEST)
    refused(far, "past the model's context")
    with pytest.raises(ValueError, match="fp8"):
        ChunkCodec(NAMESPACE, StorageDtype.FP8_E4M3, shape, 50, None)
