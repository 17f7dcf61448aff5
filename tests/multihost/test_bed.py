"""The bed itself: links shaped as asked, and nothing left behind, by a bed that fails or by
one whose process died."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.netbed import PREFIX, Bed, Link, ip, tc


def leftovers(tag: str) -> list[str]:
    """Namespaces and links whose names carry a bed's `tag`."""
    names = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link").splitlines()]
    return [n for n in names + links if f"{PREFIX}{tag}-" in n or n.startswith(f"pdb{tag}")]


def reaches(bed: Bed, source: str, target: str) -> bool:
    """Whether `source` hears back from `target` (a refused connection is an answer)."""
    code = (f"import socket; s = socket.socket(); s.settimeout(1)\n"
            f"try: s.connect(('{bed.address(target)}', 9))\n"
            f"except ConnectionRefusedError: pass")  # fmt: skip
    done = subprocess.run([*bed.exec(source), sys.executable, "-c", code], capture_output=True)
    return done.returncode == 0


def test_links_are_shaped_both_ways_and_cut():
    with Bed(["a", "b"]) as bed:
        bed.shape("a", Link(rate_bit=1e8))
        inner = tc("qdisc", "show", "dev", "eth0", netns=bed.netns["a"]).stdout
        outer = tc("qdisc", "show", "dev", bed.outer["a"]).stdout
        assert "rate 100Mbit" in inner and "rate 100Mbit" in outer
        assert reaches(bed, "b", "a")
        bed.cut("a")
        assert not reaches(bed, "b", "a")
        bed.restore("a")
        assert reaches(bed, "b", "a")
        bed.shape("a", Link())
        assert "tbf" not in tc("qdisc", "show", "dev", bed.outer["a"]).stdout


def test_a_failing_bed_leaves_nothing_and_a_dead_ones_leftovers_go():
    with pytest.raises(RuntimeError, match="boom"), Bed(["a", "b"]) as bed:
        assert len(leftovers(bed.tag)) == 5  # 2 namespaces, bridge, 2 links
        raise RuntimeError("boom")
    assert leftovers(bed.tag) == []
    dead = next(p for p in range(999_999, 0, -1) if not os.path.exists(f"/proc/{p}"))
    ip("netns", "add", f"{PREFIX}{dead}a-x")
    ip("link", "add", f"pdb{dead}a", "type", "bridge")
    with Bed(["a"]):
        assert leftovers(f"{dead}a") == []
