"""The deployment's secret for block MACs (kvstore/codec.py): read from a file, or made.

A key file holds the secret as text (surrounding whitespace ignored), at least MIN_KEY_BYTES
bytes of it: `pdserve up` writes 64 random hex digits; `openssl rand -hex 32 > kv.key` does
too. A file, not a flag: flags are visible to every user in `ps`. Every worker of a
deployment reads the same key; a worker with another key (or none) refuses the others'
blocks, as corrupt.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

log = logging.getLogger("pdserve.kvstore")
MIN_KEY_BYTES = 16  # a block MAC's key (kvstore/codec.py)


def read_key(path: str | Path) -> bytes:
    """The key in `path`; ValueError naming the file if it cannot be used."""
    try:
        key = Path(path).read_bytes().strip()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ValueError(f"kv_key_file {path}: {e.strerror or e}") from e
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"kv_key_file {path}: {len(key)} bytes of key, at least {MIN_KEY_BYTES} needed "
            "(make one: openssl rand -hex 32)"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "kv key file is readable by other users (chmod 600 it)",
            extra={"fields": {"path": str(path), "mode": oct(stat.S_IMODE(mode))}},
        )
    return key


def make_key(path: Path) -> Path:
    """`path`, holding a new random key (mode 0600) unless it already holds one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        read_key(path)  # there already: it must be usable
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path
