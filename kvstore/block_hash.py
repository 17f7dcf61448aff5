"""Content addresses of KV blocks: the hash chain of docs/design.md, shared by every service.

    h0 = SHA-256(namespace ‖ salt ‖ tokens[0:B])
    hi = SHA-256(h(i-1) ‖ tokens[iB:(i+1)B])
    partial last block (n < B tokens): SHA-256(h(i-1) ‖ tokens ‖ 0xFF ‖ n)

Tokens are little-endian int32, n a little-endian uint32. The marker and the length keep a
partial block's hash from ever equalling a full block's (a full block hashes exactly 4B bytes
after the previous hash; a partial one 4n + 5). A block's hash names its KV only together with
everything before it, which is what makes prefix reuse safe.
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
) -> list[bytes]:
    """The hash of each full block of `tokens` (and of the trailing partial one if asked)."""
    out = extend_hashes([], tokens, block_size, namespace, salt)
    rest = tokens[len(out) * block_size :]
    if include_partial and rest:
        prev = out[-1] if out else namespace.encode() + salt
        tail = _tokens(rest) + PARTIAL_MARKER + struct.pack("<I", len(rest))
        out.append(hashlib.sha256(prev + tail).digest())
    return out


def extend_hashes(
    hashes: list[bytes], tokens: Sequence[int], block_size: int, namespace: str, salt: bytes = b""
) -> list[bytes]:
    """Extend `hashes`, the hashes of the first full blocks of `tokens`, to all its full
    blocks, in place; returns it."""
    prev = hashes[-1] if hashes else namespace.encode() + salt
    for i in range(len(hashes), len(tokens) // block_size):
        block = _tokens(tokens[i * block_size : (i + 1) * block_size])
        prev = hashlib.sha256(prev + block).digest()
        hashes.append(prev)
    return hashes
