"""The loading thread's OpenMP team is released before another thread computes, so the
process keeps no more OpenMP threads than one team (libgomp sleeps its threads at once,
and every parallel region pays a wake-up, once it manages more threads than CPUs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, sys, threading, torch
from services.model.openmp import release_this_threads_team
release = sys.argv[1] == "release"
x = torch.randn(512, 512)
for _ in range(3):
    x @ x  # this thread's team
released = release_this_threads_team() if release else False
def compute():
    for _ in range(3):
        x @ x  # the computing thread's team
    print(released, len(os.listdir("/proc/self/task")), torch.get_num_threads())
t = threading.Thread(target=compute)
t.start()
t.join()
"""


CORES = len(os.sched_getaffinity(0))


def threads_after(mode: str) -> tuple[bool, int, int]:
    """Whether the team was released, the process's threads, OpenMP's team size; on every
    core (a pytest-xdist worker's OMP_NUM_THREADS, a share of them, left out)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@pytest.mark.skipif(CORES < 2, reason="one core: OpenMP starts no team")
def test_the_loading_threads_team_is_released():
    released, with_release, team = threads_after("release")
    _, without, _ = threads_after("keep")
    assert released and team == CORES
    # without: main + its team's (n - 1) threads + the computing thread + its team's (n - 1)
    assert without - with_release == team - 1
