"""Store keys for KV blocks: `pdserve:kv:<namespace>:<hash hex>` (docs/design.md).

The hash chain itself (`block_hashes`) and the namespace (`KVLayout.namespace`) live in
kvstore/block_hash.py: router, prefill and decode compute block names with that one
function, and this module only turns names into keys.
"""

from __future__ import annotations

from kvstore.block_hash import HASH_BYTES, KVLayout, block_hashes

PREFIX = "pdserve:kv:"
KEY_HASH_BYTES = 16  # 128 bits of the SHA-256 in the key: docs/design.md's floor

__all__ = ["HASH_BYTES", "PREFIX", "KVLayout", "block_hashes", "store_key"]


def store_key(namespace: str, block_hash: bytes) -> str:
    return f"{PREFIX}{namespace}:{block_hash[:KEY_HASH_BYTES].hex()}"
