"""The Triton kernels compile for a GPU (sm_90), in float32 and bfloat16, on this CPU-only
machine: the compiled path's checks that need no GPU (tests/support/triton_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_every_triton_kernel_compiles_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.triton_compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 22 and all("lines of PTX" in line for line in lines), lines
