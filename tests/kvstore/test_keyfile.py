"""Key files: read with surrounding whitespace ignored, refused (naming the file) when short or
missing, made with mode 0600 and kept when already there."""

from __future__ import annotations

import logging
import os
import stat
import subprocess

import pytest

from kvstore.keyfile import make_key, read_key
from services.launcher import PDSERVE
from tests.support.records import Records


def test_read_key_strips_whitespace_and_refuses_short_or_missing_files(tmp_path):
    path = tmp_path / "kv.key"
    path.write_text("  0123456789abcdef0123\n")
    path.chmod(0o600)
    assert read_key(path) == b"0123456789abcdef0123"
    path.write_text("short\n")
    with pytest.raises(ValueError, match=rf"kv_key_file {path}: 5 bytes of key, at least 16"):
        read_key(path)
    with pytest.raises(ValueError, match=rf"kv_key_file {tmp_path}/absent: No such file"):
        read_key(tmp_path / "absent")


def test_a_key_file_others_can_read_is_used_with_a_warning(tmp_path):
    path = tmp_path / "kv.key"
    path.write_text("k" * 32)
    path.chmod(0o644)
    handler = Records()
    logger = logging.getLogger("pdserve.kvstore")
    logger.addHandler(handler)
    try:
        assert read_key(path) == b"k" * 32
    finally:
        logger.removeHandler(handler)
    assert handler.messages == ["kv key file is readable by other users (chmod 600 it)"]


def test_make_key_writes_64_hex_digits_0600_once(tmp_path):
    old = os.umask(0)  # the mode must not depend on the umask
    try:
        path = make_key(tmp_path / "kv.key")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = read_key(path)
    assert len(key) == 64 and int(key, 16) >= 0
    assert read_key(make_key(path)) == key  # there already: kept
    (tmp_path / "bad.key").write_text("x")
    with pytest.raises(ValueError, match="1 bytes of key"):
        make_key(tmp_path / "bad.key")


def test_a_worker_with_an_unusable_key_file_stops_with_the_reason(tmp_path):
    out = subprocess.run(
        [PDSERVE, "decode", "--kv-key-file", str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"pdserve: error: kv_key_file {tmp_path}/absent: No such file or directory"
    )
