"""Freed memory stays in the process: a thread that allocates a step's worth of temporaries
again and again (as the engine thread does) faults its pages in once, not every step."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, threading, torch
from services.model.allocator import keep_freed_memory
kept = keep_freed_memory()
faults = []
def steps():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        # a step's temporaries: sizes from 1 to 31 MB, each written, freed out of order
        held = [torch.ones(mb << 18) for mb in (31, 4, 17, 1, 9, 24)]
        del held[1::2]
        held += [torch.ones(mb << 18) for mb in (12, 2, 28)]
        del held
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=steps)  # its own malloc arena, as the engine thread's
t.start()
t.join()
print(kept, *faults)
"""


def run(malloc: str | None = None) -> tuple[bool, list[int]]:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_MALLOC"}
    if malloc is not None:
        env["PDSERVE_MALLOC"] = malloc
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    return out[0] == "True", [int(f) for f in out[1:]]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_a_steps_temporaries_reuse_the_last_steps_pages():
    kept, faults = run()
    assert kept
    first, later = faults[0], faults[2:]  # the second step still settles the heap
    assert first > 20_000  # 128 MB written: its pages faulted in once...
    assert max(later) < 0.05 * first, faults  # ...then reused (measured: 768, 0, 0, 0 pages)


def test_pdserve_malloc_default_leaves_glibc_alone():
    kept, _ = run("default")
    assert not kept
