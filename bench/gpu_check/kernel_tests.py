"""Section 1: pytest on the Triton kernel tests, on the checked device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

from bench.gpu_check.check import REPO, Check, Skip
from bench.offline import log

FILES = tuple(
    f"tests/services/model/test_triton_{name}.py"
    for name in ("layer_ops", "attention", "mla", "fp8", "row_gemm")
)


def run(check: Check, numbers: dict[str, Any]) -> bool:
    files = [f for f in FILES if (REPO / f).exists()]
    numbers["files"], numbers["missing"] = files, [f for f in FILES if f not in files]
    if not files:
        raise Skip("no Triton kernel test file yet")
    env = {**os.environ, "PDSERVE_TEST_DEVICE": check.device.type}
    if check.device.type == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # also where torch sees a GPU
    selected = ["-k", check.sizes.kernel_tests] if check.sizes.kernel_tests else []
    numbers["selected"] = check.sizes.kernel_tests or "all"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selected, *files]
    log(f"  {' '.join(argv[1:])}")
    done = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(10.0, check.left())
    )
    lines = done.stdout.strip().splitlines() or [""]
    numbers |= {"returncode": done.returncode, "summary": lines[-1]}
    counts = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", lines[-1])
    numbers |= {kind: int(count) for count, kind in counts}
    if done.returncode != 0:  # 5 also: the -k expression chose no test
        numbers["tail"] = "\n".join(lines[-40:]) + done.stderr[-2000:]
    return done.returncode == 0


def summary(n: dict[str, Any]) -> str:
    chosen = "" if n["selected"] == "all" else f" (-k {n['selected']!r})"
    return f"{n['summary']}{chosen}; missing: {', '.join(n['missing']) or 'none'}"
