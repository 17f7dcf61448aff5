"""local://PATH — the embedded store: one file per block under PATH/<namespace>/.

For the processes of one host and one user (prefill and decode workers started by `pdserve
up`), with no server to run. A value is written to a temporary file and renamed into place, so
a reader sees the whole value or none of it. Reads refresh a file's mtime; when the directory
passes its size cap, the least recently used files go first. File I/O runs on a worker thread
so the event loop (and the timeout) keep running.

Access: whoever can write to the directory can plant KV (with no key, see kvstore/codec.py),
and whoever can read it can read prompts' KV. So the directories are this user's alone: made
with mode 0700, files written 0600, and a directory that another user owns or that others
may write to is refused (group-writable: a warning). A bare `local://` is this user's
default directory, in RAM where there is one: /dev/shm/pdserve-<uid> (else under the temp
directory); `pdserve up` gives its workers a directory of the stack's own inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvstore.store import Backend, Value

log = logging.getLogger("pdserve.kvstore")
RAM_DIR = Path("/dev/shm")


class UnsafeDirectory(PermissionError):
    """A local:// directory that other users could write to (or that is theirs)."""


def default_dir() -> Path:
    """This user's directory for local:// stores (not made here)."""
    base = RAM_DIR if RAM_DIR.is_dir() else Path(tempfile.gettempdir())
    return base / f"pdserve-{os.getuid()}"


def path_of(url: str) -> Path:
    raw = url.removeprefix("local://")
    return Path(raw) if raw else default_dir()


def private_dir(path: Path) -> Path:
    """`path` as a directory of this user's: made with mode 0700 if missing (missing parents
    as by mkdir -p); UnsafeDirectory if another user owns it or anyone else may write to it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(
            f"{path} belongs to user {st.st_uid}, not to this user ({os.getuid()}): its blocks "
            "could be planted or read by them; use a directory of your own (local://PATH)"
        )
    if mode & stat.S_IWOTH:
        raise UnsafeDirectory(
            f"{path} is writable by every user (mode {mode:o}): anyone could plant blocks; "
            f"chmod 700 {path}, or use another directory"
        )
    if mode & stat.S_IWGRP:
        log.warning(
            "local store directory is group-writable: the group can plant blocks (chmod 700)",
            extra={"fields": {"path": str(path), "mode": f"{mode:o}"}},
        )
    return path


class LocalStore(Backend):
    def __init__(self, url: str, namespace: str, timeout: float, max_bytes: int | None) -> None:
        super().__init__(namespace, timeout)
        self.root = private_dir(private_dir(path_of(url)) / namespace)
        self.max_bytes = max_bytes
        self._since_check = 0  # bytes written since the size was last measured
        self._last_use = 0

    def _touch(self, path: Path) -> None:
        """Stamp a file as just used. File times are coarse (a few ms), so the stamp is made
        strictly increasing within this process: least recently used stays well defined."""
        self._last_use = max(time.time_ns(), self._last_use + 1)
        with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
            os.utime(path, ns=(self._last_use, self._last_use))

    def _file(self, block_hash: bytes) -> Path:
        return self.root / block_hash.hex()

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        if items:
            async with self.guarded("put"):
                await asyncio.to_thread(self._put, items)
            self.count_put(items)

    async def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        async with self.guarded("get"):
            values = await asyncio.to_thread(lambda: [self._read(h) for h in hashes])
        self.count_get(values)
        return values

    async def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        async with self.guarded("exists"):
            present = await asyncio.to_thread(lambda: [self._file(h).is_file() for h in hashes])
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    async def delete(self, hashes: Sequence[bytes]) -> None:
        async with self.guarded("delete"):
            await asyncio.to_thread(self._delete, hashes)

    async def close(self) -> None:
        return None

    def _put(self, items: Sequence[tuple[bytes, Value]]) -> None:
        for h, value in items:
            final = self._file(h)
            tmp = self.root / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, final)  # atomic: readers see all of the value or none
            self._touch(final)
            self._since_check += len(value)
        if self.max_bytes is not None and self._since_check > self.max_bytes // 10:
            self._evict()

    def _delete(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._file(h).unlink(missing_ok=True)

    def _read(self, block_hash: bytes) -> bytes | None:
        path = self._file(block_hash)
        try:
            data = path.read_bytes()
            self._touch(path)
        except FileNotFoundError:  # never written, evicted, or deleted (also mid-read)
            return None
        return data

    def _evict(self) -> None:
        """Delete least recently used files until the directory is under 90% of its cap."""
        assert self.max_bytes is not None
        self._since_check = 0
        files = []
        for entry in os.scandir(self.root):
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes * 0.9:
                break
            Path(path).unlink(missing_ok=True)
            total -= size
            self._stats.evicted += 1
