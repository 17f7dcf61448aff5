"""local:// is this user's alone: directories 0700, files 0600, a per-user default directory,
and directories that others own or may write to refused."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvstore import local, open_store
from services.launcher import PDSERVE
from tests.support.records import Records

NS = "2" * 32
ITEM = (b"\x05" * 32, b"block bytes")


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def put_one(url: str) -> None:
    async def go() -> None:
        store = open_store(url, NS)
        await store.put_many([ITEM])
        assert await store.get_many([ITEM[0]]) == [ITEM[1]]
        await store.close()

    asyncio.run(go())


def test_directories_0700_and_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        put_one(f"local://{tmp_path}/kv")
    finally:
        os.umask(old)
    root = tmp_path / "kv" / NS
    assert mode(tmp_path / "kv") == 0o700 and mode(root) == 0o700
    files = list(root.iterdir())
    assert [f.name for f in files] == [ITEM[0].hex()]
    assert mode(files[0]) == 0o600


def test_a_bare_url_is_this_users_default_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "RAM_DIR", tmp_path)
    assert local.default_dir() == tmp_path / f"pdserve-{os.getuid()}"
    put_one("local://")
    assert mode(tmp_path / f"pdserve-{os.getuid()}") == 0o700
    assert (tmp_path / f"pdserve-{os.getuid()}" / NS / ITEM[0].hex()).is_file()
    monkeypatch.setattr(local, "RAM_DIR", tmp_path / "no-such-ram-dir")  # no /dev/shm
    assert local.default_dir() == Path(tempfile.gettempdir()) / f"pdserve-{os.getuid()}"


def test_a_world_writable_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(local.UnsafeDirectory, match=r"writable by every user \(mode 777\)"):
        open_store(f"local://{shared}", NS)
    shared.chmod(0o700)
    (shared / NS).mkdir(mode=0o700)
    (shared / NS).chmod(0o1777)  # sticky or not, others could plant files in it
    with pytest.raises(local.UnsafeDirectory, match=f"{NS} is writable by every user"):
        open_store(f"local://{shared}", NS)


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    me = os.getuid()
    monkeypatch.setattr(local.os, "getuid", lambda: me + 4242)  # as seen by another user
    with pytest.raises(
        local.UnsafeDirectory, match=rf"belongs to user {me}, not to this user \({me + 4242}\)"
    ):
        open_store(f"local://{theirs}", NS)


def test_a_group_writable_directory_is_used_with_a_warning(tmp_path):
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o770)
    handler = Records()
    logging.getLogger("pdserve.kvstore").addHandler(handler)
    try:
        put_one(f"local://{group}")
    finally:
        logging.getLogger("pdserve.kvstore").removeHandler(handler)
    assert handler.messages == [
        "local store directory is group-writable: the group can plant blocks (chmod 700)"
    ]


def test_a_worker_refuses_an_unsafe_directory_before_loading_the_model(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    out = subprocess.run(
        [PDSERVE, "prefill", "--kv-store", f"local://{shared}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"pdserve: error: {shared} is writable by every user (mode 777): anyone could plant "
        f"blocks; chmod 700 {shared}, or use another directory"
    )
