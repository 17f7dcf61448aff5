"""The block hash chain, byte for byte as docs/design.md defines it."""

from __future__ import annotations

import hashlib
import struct

from kvstore.block_hash import KVLayout, block_hashes, extend_hashes

NS = "0123456789abcdef0123456789abcdef"


def _le(tokens):
    return b"".join(struct.pack("<i", t) for t in tokens)


def test_chain_definition():
    tokens = list(range(100, 140))  # 2 full blocks of 16, 8 left over
    h = block_hashes(tokens, 16, NS, salt=b"tenant", include_partial=True)
    h0 = hashlib.sha256(NS.encode() + b"tenant" + _le(tokens[:16])).digest()
    h1 = hashlib.sha256(h0 + _le(tokens[16:32])).digest()
    partial = hashlib.sha256(h1 + _le(tokens[32:]) + b"\xff" + struct.pack("<I", 8)).digest()
    assert h == [h0, h1, partial]


def test_prefix_property_and_salt():
    a = block_hashes(list(range(64)), 16, NS)
    b = block_hashes([*range(48), 7, *range(49, 64)], 16, NS)
    assert a[:3] == b[:3] and a[3] != b[3]
    assert block_hashes(list(range(64)), 16, NS, salt=b"other")[0] != a[0]
    assert len(block_hashes(list(range(15)), 16, NS)) == 0


def test_extend_matches_whole_computation():
    tokens = list(range(70))
    grown = extend_hashes([], tokens[:20], 16, NS)
    assert extend_hashes(grown, tokens, 16, NS) == block_hashes(tokens, 16, NS)


def test_namespace_changes_with_layout():
    base = KVLayout("m", "bfloat16", 16, 30, 3, 64)
    assert len(base.namespace()) == 32
    assert base.namespace() != KVLayout("m", "float32", 16, 30, 3, 64).namespace()
    assert base.namespace() != KVLayout("m", "bfloat16", 32, 30, 3, 64).namespace()
    assert base.namespace() == KVLayout("m", "bfloat16", 16, 30, 3, 64).namespace()
    # a row laid out otherwise (DeepSeek-V4's two pools) is another namespace: no store value
    # of the earlier layout is read as this one
    assert base.namespace() != KVLayout("m", "bfloat16", 16, 30, 3, 64, row_layout="x").namespace()
