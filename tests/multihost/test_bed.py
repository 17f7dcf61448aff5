"""The bed itself: links shaped as asked, and nothing left behind, by a bed that fails or by
one whose process died."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support.netbed import PREFIX, Bed, Link, ip, tc


def leftovers(tag: str) -> list[str]:
    """Namespaces and links whose names carry a bed's `tag`."""
    names = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link").splitlines()]
    return [n for n in names + links if f"{PREFIX}{tag}-" in n or n.startswith(f"pdb{tag}")]


def reaches(bed: Bed, source: str | None, target: str) -> bool:
    """Whether `source` (None: the root namespace) hears back from `target` (a refused
    connection is an answer)."""
    code = (
        f"import socket; s = socket.socket(); s.settimeout(1)\n"
        f"try: s.connect(('{bed.address(target)}', 9))\n"
        f"except ConnectionRefusedError: pass"
    )
    prefix = bed.exec(source) if source else []
    done = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True)
    return done.returncode == 0


def iptables(*args: str) -> str:
    return subprocess.run(["iptables", *args], capture_output=True, text=True, check=True).stdout


def test_links_are_shaped_both_ways_and_cut():
    with Bed(["a", "b"]) as bed:
        bed.shape("a", Link(rate_bit=1e8))
        inner = tc("qdisc", "show", "dev", "eth0", netns=bed.netns["a"]).stdout
        outer = tc("qdisc", "show", "dev", bed.outer["a"], netns=bed.switch).stdout
        assert "rate 100Mbit" in inner and "rate 100Mbit" in outer
        assert reaches(bed, "b", "a")
        bed.cut("a")
        assert not reaches(bed, "b", "a")
        bed.restore("a")
        assert reaches(bed, "b", "a")
        bed.shape("a", Link())
        assert "tbf" not in tc("qdisc", "show", "dev", bed.outer["a"], netns=bed.switch).stdout


@pytest.mark.skipif(shutil.which("iptables") is None, reason="no iptables here")
def test_this_machines_firewall_is_not_in_the_way():
    """Once dockerd has run, the root namespace drops what it forwards (and br_netfilter sends
    bridged frames through that): the bed's hosts still reach each other and the test."""
    policy = re.search(r"-P FORWARD (\w+)", iptables("-S", "FORWARD"))
    assert policy, "iptables -S FORWARD printed no policy"
    iptables("-P", "FORWARD", "DROP")
    try:
        with Bed(["a", "b"]) as bed:
            assert reaches(bed, "b", "a") and reaches(bed, "a", "b") and reaches(bed, None, "a")
    finally:
        iptables("-P", "FORWARD", policy.group(1))


def test_a_failing_bed_leaves_nothing_and_a_dead_ones_leftovers_go():
    with pytest.raises(RuntimeError, match="boom"), Bed(["a", "b"]) as bed:
        assert len(leftovers(bed.tag)) == 4  # 2 hosts' namespaces, the switch's, the root's link
        raise RuntimeError("boom")
    assert leftovers(bed.tag) == []
    dead = next(p for p in range(999_999, 0, -1) if not os.path.exists(f"/proc/{p}"))
    ip("netns", "add", f"{PREFIX}{dead}a-x")
    ip("link", "add", f"pdb{dead}a", "type", "bridge")
    with Bed(["a"]):
        assert leftovers(f"{dead}a") == []
