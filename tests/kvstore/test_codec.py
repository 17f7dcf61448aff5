"""The block codec: exact round trips, the fp8 error bound, and no way to smuggle anything
past the checks."""

from __future__ import annotations

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block_hash import KVLayout
from kvstore.blocks import StoredBlocks
from kvstore.codec import (
    FLAG_MAC,
    FORMAT,
    MAC_BYTES,
    BlockCodec,
    CodecError,
    StorageDtype,
    mac,
)
from services.model.config import ModelConfig
from services.model.kv_cache import KVCache

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
        (
            BlockCodec(KVLayout("model-b", "bfloat16", 16, 4, 3, 64), StorageDtype.BFLOAT16),
            "namespace does not match",
        ),
        (BlockCodec(LAYOUT, StorageDtype.FLOAT16), "dtype 2, expected 1"),
        (
            BlockCodec(KVLayout("model-a", "bfloat16", 16, 4, 3, 32), StorageDtype.BFLOAT16),
            "head dim 64, expected 32",
        ),
    ],
)
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


# -- keyed codecs: a MAC over header, scales and payload --------------------------------

KEY = b"k" * 32


def forge(value: bytes, payload: bytes, keep_mac: bool) -> bytes:
    """What a writer without the key can make from a genuine value: the same header (hash,
    namespace, sizes) with `payload` and a recomputed xxh3; either still flagged as keyed,
    with the old MAC, or as an unkeyed value."""
    fields = list(FORMAT.unpack_from(value))
    fields[-1] = xxhash.xxh3_64_intdigest(payload)
    if keep_mac:
        return FORMAT.pack(*fields) + payload + value[-MAC_BYTES:]
    fields[3] = 0  # flags
    return FORMAT.pack(*fields) + payload


@pytest.mark.parametrize("dtype", [StorageDtype.BFLOAT16, StorageDtype.FP8_E4M3])
def test_keyed_round_trip_carries_a_mac(dtype):
    keyed = BlockCodec(LAYOUT, dtype, KEY)
    k, v = blocks(dtype.torch if dtype is not StorageDtype.FP8_E4M3 else torch.float32)
    values = [bytes(x) for x in keyed.encode_many(k, v, HASHES, [16] * N)]
    unkeyed = BlockCodec(LAYOUT, dtype)
    assert keyed.value_bytes == unkeyed.value_bytes + MAC_BYTES == len(values[0])
    assert FORMAT.unpack_from(values[0])[3] == FLAG_MAC
    for value in values:
        assert value[-MAC_BYTES:] == mac(KEY, value[:-MAC_BYTES])
    decoded = keyed.decode_many(values, HASHES, torch.float32)
    plain = unkeyed.encode_many(k, v, HASHES, [16] * N)
    expected = unkeyed.decode_many([bytes(x) for x in plain], HASHES, torch.float32)
    assert torch.equal(decoded.k, expected.k) and torch.equal(decoded.v, expected.v)
    # decode_into reads the payload only, not the MAC after it
    ck, cv = torch.empty(4, 3, 64, 16), torch.empty(4, 3, 16, 64)
    keyed.decode_into(values[2], ck, cv)
    assert torch.equal(ck, expected.k[2]) and torch.equal(cv, expected.v[2])


def _keyed_value():
    codec = BlockCodec(LAYOUT, StorageDtype.BFLOAT16, KEY)
    k, v = blocks(torch.bfloat16)
    return codec, bytes(codec.encode_many(k[:1], v[:1], HASHES[:1], [16])[0])


def test_keyed_and_unkeyed_readers_refuse_each_other():
    keyed, keyed_value = _keyed_value()
    unkeyed, plain_value = _one_value()
    with pytest.raises(CodecError, match=r"^no MAC, and this reader has a key$"):
        keyed.check(plain_value, HASHES[0])
    with pytest.raises(CodecError, match=r"^a MAC, and this reader has no key$"):
        unkeyed.check(keyed_value, HASHES[0])
    other = BlockCodec(LAYOUT, StorageDtype.BFLOAT16, b"another key, as long" * 2)
    with pytest.raises(CodecError, match=r"^MAC does not match: forged, or written with another"):
        other.check(keyed_value, HASHES[0])
    assert keyed.check(keyed_value, HASHES[0]) == 16


def test_forged_payloads_are_refused_with_a_key_and_taken_without_one():
    keyed, value = _keyed_value()
    zeros = bytes(keyed.payload_bytes)
    with pytest.raises(CodecError, match=r"^MAC does not match"):
        keyed.check(forge(value, zeros, keep_mac=True), HASHES[0])
    with pytest.raises(CodecError, match=r"^no MAC"):
        keyed.check(forge(value, zeros, keep_mac=False), HASHES[0])
    # what the key is for: without one, the same forgery is a valid block (checksum only)
    unkeyed = BlockCodec(LAYOUT, StorageDtype.BFLOAT16)
    assert unkeyed.check(forge(value, zeros, keep_mac=False), HASHES[0]) == 16
    decoded = unkeyed.decode_many([forge(value, zeros, keep_mac=False)], HASHES[:1])
    assert not decoded.k.any() and not decoded.v.any()


def test_a_tampered_header_field_is_refused_by_the_mac():
    """The token count is checked for its range only, and the checksum covers the payload:
    in a keyed value, the MAC is what catches a changed count."""
    keyed, value = _keyed_value()
    fields = list(FORMAT.unpack_from(value))
    fields[6] = 7  # num_tokens: 16 -> 7, a valid count
    tampered = FORMAT.pack(*fields) + value[FORMAT.size :]
    with pytest.raises(CodecError, match=r"^MAC does not match"):
        keyed.check(tampered, HASHES[0])
    unkeyed, plain = _one_value()
    assert (
        unkeyed.check(FORMAT.pack(*fields[:3], 0, *fields[4:]) + plain[FORMAT.size :], HASHES[0])
        == 7
    )


def test_every_flipped_bit_of_a_keyed_value_is_refused_with_a_reason():
    keyed, value = _keyed_value()
    reasons = set()
    payload_end = len(value) - MAC_BYTES
    for byte in [
        *range(FORMAT.size),
        *range(FORMAT.size, payload_end, 4099),
        *range(payload_end, len(value)),
    ]:
        for bit in (0, 7):
            flipped = bytearray(value)
            flipped[byte] ^= 1 << bit
            if FORMAT.size <= byte < payload_end:  # the forger's part: a valid checksum
                fields = list(FORMAT.unpack_from(flipped))
                fields[-1] = xxhash.xxh3_64_intdigest(bytes(flipped[FORMAT.size : payload_end]))
                FORMAT.pack_into(flipped, 0, *fields)
            with pytest.raises(CodecError) as e:
                keyed.check(bytes(flipped), HASHES[0])
            reasons.add(e.value.reason.split(":")[0].split(",")[0])
            if byte >= FORMAT.size:
                assert e.value.reason.startswith("MAC does not match"), byte
    assert {
        "MAC does not match",
        "checksum does not match",
        "bad magic",
        "namespace does not match",
        "block hash does not match",
    } <= reasons


def test_a_short_key_is_refused_and_never_shown():
    with pytest.raises(ValueError, match="at least 16 bytes, got 5"):
        BlockCodec(LAYOUT, StorageDtype.BFLOAT16, b"short")
    codec = BlockCodec(LAYOUT, StorageDtype.BFLOAT16, KEY)
    assert "kkkk" not in repr(codec) and "keyed" in repr(codec)


KEYED, KEYED_VALUE = _keyed_value()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    cut=st.integers(min_value=0, max_value=len(KEYED_VALUE)),
    flips=st.lists(st.integers(min_value=0, max_value=len(KEYED_VALUE) * 8 - 1), max_size=8),
    fix_checksum=st.booleans(),
)
def test_fuzzed_keyed_values_only_ever_raise_codec_error(cut, flips, fix_checksum):
    value = bytearray(KEYED_VALUE[:cut])
    for bit in flips:
        if bit // 8 < len(value):
            value[bit // 8] ^= 1 << (bit % 8)
    if fix_checksum and len(value) >= FORMAT.size:
        fields = list(FORMAT.unpack_from(value))
        fields[-1] = xxhash.xxh3_64_intdigest(bytes(value[FORMAT.size : -MAC_BYTES]))
        FORMAT.pack_into(value, 0, *fields)
    try:
        KEYED.check(bytes(value), HASHES[0])
    except CodecError:
        return
    assert bytes(value) == KEYED_VALUE  # anything accepted is the original value


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_stored_blocks_staged_for_a_device_write_the_bytes_written_block_by_block(cache_dtype):
    """A GPU pool takes imported blocks through one host buffer and one copy (write_staged);
    run here on CPU pools: the same bytes as decoding each block in place, both layouts."""
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=192,
        intermediate_size=160,
        num_layers=4,
        num_heads=3,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    codec = BlockCodec(LAYOUT, StorageDtype.BFLOAT16)
    k, v = blocks(torch.bfloat16)
    source = StoredBlocks(codec, [bytes(x) for x in codec.encode_many(k, v, HASHES, [16] * N)])
    items = [(0, 6), (3, 1), (4, 9), (1, 2)]
    caches = [KVCache(config, 10, 16, cache_dtype) for _ in range(2)]
    source.write(caches[0], items)
    source.write_staged(caches[1], items)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert caches[1].k[:, 6].abs().sum() > 0 and caches[1].k[:, 0].abs().sum() == 0
