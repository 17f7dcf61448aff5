"""Images in the block hash chain (kvstore/block_hash.py), byte for byte: a block holding any
of an image's placeholders hashes its tokens, 0xFE and the digest of each image it touches, in
the order they start; every other block hashes as it did before images."""

from __future__ import annotations

import hashlib
import struct

from kvstore.block_hash import ImageSpan, block_hashes, extend_hashes, image_digest

NS = "0123456789abcdef0123456789abcdef"
TOKENS = list(range(100, 170))  # 4 full blocks of 16, 6 left over
A, B = image_digest(b"one image", "{}"), image_digest(b"another", "{}")


def _le(tokens):
    return b"".join(struct.pack("<i", t) for t in tokens)


def sha(*parts: bytes) -> bytes:
    return hashlib.sha256(b"".join(parts)).digest()


def test_no_images_hash_as_before():
    """images=() is the chain without the argument, full and partial blocks alike."""
    for partial in (False, True):
        before = block_hashes(TOKENS, 16, NS, b"salt", include_partial=partial)
        assert block_hashes(TOKENS, 16, NS, b"salt", partial, images=()) == before
    assert extend_hashes([], TOKENS, 16, NS, images=()) == block_hashes(TOKENS, 16, NS)


def test_chain_definition_with_images():
    """Image A over 20..36 (blocks 1 and 2), B over 40..56 (blocks 2 and 3): block 2 names
    both, A first; block 0 and the partial block 4 name none."""
    images = [ImageSpan(20, 16, A), ImageSpan(40, 16, B)]
    h = block_hashes(TOKENS, 16, NS, b"tenant", include_partial=True, images=images)
    h0 = sha(NS.encode(), b"tenant", _le(TOKENS[:16]))
    h1 = sha(h0, _le(TOKENS[16:32]), b"\xfe", A)
    h2 = sha(h1, _le(TOKENS[32:48]), b"\xfe", A, B)
    h3 = sha(h2, _le(TOKENS[48:64]), b"\xfe", B)
    h4 = sha(h3, _le(TOKENS[64:]), b"\xff", struct.pack("<I", 6))
    assert h == [h0, h1, h2, h3, h4]


def test_a_partial_block_names_its_images():
    """An image in the trailing partial block: its digest before the partial marker, and a
    hash other than the same tokens' without it."""
    image = ImageSpan(66, 2, A)
    h = block_hashes(TOKENS, 16, NS, include_partial=True, images=[image])
    without = block_hashes(TOKENS, 16, NS, include_partial=True)
    assert h[:4] == without[:4]
    assert h[4] == sha(h[3], _le(TOKENS[64:]), b"\xfe", A, b"\xff", struct.pack("<I", 6))
    assert h[4] != without[4]


def test_a_block_changes_where_an_image_touches_it_and_after():
    """Each block before the first one an image touches keeps its hash; that block and every
    later one change (the chain), whether the image fills a block, starts on its last
    position or crosses into the next. The block after one that an image ends with adds no
    digest of its own."""
    plain = block_hashes(TOKENS, 16, NS)
    for start, length in [(0, 16), (15, 1), (16, 16), (31, 2), (20, 12), (48, 16)]:
        h = block_hashes(TOKENS, 16, NS, images=[ImageSpan(start, length, A)])
        first = start // 16
        assert h[:first] == plain[:first], (start, length)
        assert all(a != b for a, b in zip(h[first:], plain[first:], strict=True)), (start, length)
    h = block_hashes(TOKENS, 16, NS, images=[ImageSpan(0, 16, A)])
    assert h[1] == sha(h[0], _le(TOKENS[16:32]))


def test_each_block_names_the_images_it_touches():
    """Two chains whose second image differs agree up to block 1, which holds the first image
    alone, and part from block 2, where the second starts; the same two images the other way
    round part from block 1."""

    def chain(first: bytes, second: bytes) -> list[bytes]:
        images = [ImageSpan(20, 16, first), ImageSpan(40, 16, second)]
        return block_hashes(TOKENS, 16, NS, images=images)

    a_b, a_a, b_a = chain(A, B), chain(A, A), chain(B, A)
    assert a_b[:2] == a_a[:2] and a_b[2] != a_a[2] and a_b[3] != a_a[3]
    assert a_b[0] == b_a[0] and all(x != y for x, y in zip(a_b[1:], b_a[1:], strict=True))


def test_extend_with_images_matches_the_whole_computation():
    """Grown as tokens arrive, the chain with images is the one computed at once."""
    images = [ImageSpan(20, 16, A), ImageSpan(40, 16, B)]
    grown = extend_hashes([], TOKENS[:35], 16, NS, images=images)
    assert len(grown) == 2
    assert extend_hashes(grown, TOKENS, 16, NS, images=images) == block_hashes(
        TOKENS, 16, NS, images=images
    )


def test_image_digest_names_the_file_and_the_settings():
    """SHA-256 over a fixed prefix, the settings' length and text, then the file: other bytes
    or other preprocessing settings are another image."""
    assert image_digest(b"one image", "{}") == sha(
        b"pdserve-image\0", struct.pack("<I", 2), b"{}", b"one image"
    )
    assert image_digest(b"one image", '{"size": 1}') != A
