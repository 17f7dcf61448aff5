"""The block codec: exact round trips, the fp8 error bound, and no way to smuggle anything
past the checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.codec import FORMAT, BlockCodec, CodecError, StorageDtype
from services.engine.block_hash import KVLayout

LAYOUT = KVLayout("model-a", "bfloat16", 16, 4, 3, 64)  # small: 4 layers
N = 5


def blocks(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(N, 4, 3, 64, 16, generator=gen) * 3
    v = torch.randn(N, 4, 3, 16, 64, generator=gen)
    return k.to(dtype), v.to(dtype)


HASHES = [bytes([i]) * 32 for i in range(N)]


@pytest.mark.parametrize(
    "dtype", [StorageDtype.FLOAT32, StorageDtype.FLOAT16, StorageDtype.BFLOAT16]
)
def test_round_trip_is_byte_identical(dtype):
    codec = BlockCodec(LAYOUT, dtype)
    k, v = blocks(dtype.torch)
    values = codec.encode_many(k, v, HASHES, [16, 16, 16, 16, 7])
    assert all(len(x) == codec.value_bytes for x in values)
    decoded = codec.decode_many([bytes(x) for x in values], HASHES, dtype.torch)
    assert torch.equal(decoded.k, k) and torch.equal(decoded.v, v)
    assert decoded.num_tokens == [16, 16, 16, 16, 7]
    again = codec.encode_many(decoded.k, decoded.v, HASHES, decoded.num_tokens)
    assert [bytes(x) for x in again] == [bytes(x) for x in values]


def test_fp8_stays_within_the_format_bound_and_halves_bf16():
    fp8, bf16 = BlockCodec(LAYOUT, StorageDtype.FP8_E4M3), BlockCodec(LAYOUT, StorageDtype.BFLOAT16)
    k, v = blocks()
    decoded = fp8.decode_many([bytes(x) for x in fp8.encode_many(k, v, HASHES, [16] * N)], HASHES)
    for x, y in ((k, decoded.k), (v, decoded.v)):
        amax = x.abs().flatten(2).amax(-1)[..., None, None, None]  # per block and layer
        # e4m3: 3 mantissa bits (relative error <= 2^-4) down to its smallest subnormal step
        bound = x.abs() / 16 + amax / 448 * 2.0**-9
        assert ((x - y).abs() <= bound).all()
    assert fp8.value_bytes - fp8.scales_bytes - FORMAT.size == (bf16.value_bytes - FORMAT.size) // 2


def _one_value(dtype=StorageDtype.BFLOAT16):
    codec = BlockCodec(LAYOUT, dtype)
    k, v = blocks(dtype.torch if dtype is not StorageDtype.FP8_E4M3 else torch.float32)
    return codec, bytes(codec.encode_many(k[:1], v[:1], HASHES[:1], [16])[0])


@pytest.mark.parametrize(
    ("reader", "reason"),
    [
        (BlockCodec(KVLayout("model-b", "bfloat16", 16, 4, 3, 64), StorageDtype.BFLOAT16),
         "namespace does not match"),
        (BlockCodec(LAYOUT, StorageDtype.FLOAT16), "dtype 2, expected 1"),
        (BlockCodec(KVLayout("model-a", "bfloat16", 16, 4, 3, 32), StorageDtype.BFLOAT16),
         "head dim 64, expected 32"),
    ],
)  # fmt: skip
def test_a_value_for_another_layout_is_refused(reader, reason):
    _, value = _one_value()
    with pytest.raises(CodecError, match=reason):
        reader.check(value, HASHES[0])


def test_wrong_hash_size_and_checksum_are_refused():
    codec, value = _one_value()
    with pytest.raises(CodecError, match="block hash"):
        codec.check(value, HASHES[1])
    with pytest.raises(CodecError, match="size"):
        codec.check(value + b"\0", HASHES[0])
    flipped = bytearray(value)
    flipped[-1] ^= 0x01
    with pytest.raises(CodecError, match="checksum"):
        codec.check(bytes(flipped), HASHES[0])
    assert codec.check(value, HASHES[0]) == 16


CODEC, VALUE = _one_value(StorageDtype.FP8_E4M3)


def test_every_header_byte_is_checked():
    for i in range(FORMAT.size - 8):  # the last 8 are the checksum itself
        flipped = bytearray(VALUE)
        flipped[i] ^= 0x10
        with pytest.raises(CodecError):
            CODEC.check(bytes(flipped), HASHES[0])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    cut=st.integers(min_value=0, max_value=len(VALUE)),
    flips=st.lists(st.integers(min_value=0, max_value=len(VALUE) * 8 - 1), max_size=8),
    junk=st.binary(max_size=256),
    replace_header=st.booleans(),
)
def test_fuzzed_values_only_ever_raise_codec_error(cut, flips, junk, replace_header):
    value = bytearray(VALUE[:cut])
    for bit in flips:
        if bit // 8 < len(value):
            value[bit // 8] ^= 1 << (bit % 8)
    if replace_header:
        value[: len(junk)] = junk
    try:
        decoded = CODEC.decode_many([bytes(value)], HASHES[:1])
    except CodecError:
        return
    # anything accepted is the original value, whole and unchanged
    assert bytes(value) == VALUE
    assert decoded.num_tokens == [16]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=FORMAT.size * 2))
def test_random_bytes_are_refused(data):
    with pytest.raises(CodecError):
        CODEC.check(data, HASHES[0])
