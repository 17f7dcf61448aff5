"""C kernels for CPUs, compiled on first use with the machine's C compiler and cached.

A kernel is built with -march=native for the CPU it runs on, into the pdserve cache under a
name that hashes its source, the flags and the CPU's identity. Without a compiler (or with
PDSERVE_KERNELS=0) `load` returns None and callers keep their torch path.

OpenMP: the library links libgomp.so.1, which torch has already loaded, so the kernels share
torch's thread pool and its thread count instead of starting a second pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from services.model.kernels import gpu  # noqa: F401  (see below)

# The Triton kernels (gpu/) run in Triton's interpreter on a CPU: gpu/__init__.py chooses it,
# and must before anything imports triton (which wraps its own library's functions then, as
# interpreted or compiled). Everything that computes imports this package first.
log = logging.getLogger("pdserve.kernels")

HERE = Path(__file__).parent
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# Attention may assume finite numbers, but neither reorder a sum (-ffast-math would: GCC then
# reassociated the decode and the prefill kernel's sums differently, and a token's attention
# took other bits computed one way or the other; linked with it, the library also switched on
# flush-to-zero for the whole process) nor fuse a multiply and an add where it sees fit
# (-ffp-contract=fast fused other products in the two kernels on an AVX2 CPU): its products
# are fused where the source says so (vectors.h fmadd), so its shared per-block functions
# compile the same wherever they are inlined. The layer ops keep IEEE rounding (-std=c11
# contracts nothing) to match torch's.
ATTENTION_FLAGS = [
    "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-ffinite-math-only",
    "-fno-signed-zeros",
]  # fmt: skip
EXTRA_FLAGS = {"paged_attention": ATTENTION_FLAGS, "mla_attention": ATTENTION_FLAGS}


def flags(name: str) -> list[str]:
    return FLAGS + EXTRA_FLAGS.get(name, [])


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build(source: Path, out: Path, flags: list[str]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        subprocess.run(
            [compiler, *flags, "-o", str(target), str(source), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        target.rename(out)  # atomic: concurrent workers never load half a library


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled library `name` (kernels/<name>.c), or None where it cannot be built."""
    if os.environ.get("PDSERVE_KERNELS", "1") == "0":
        return None
    from services.model.loading.sources import cache_root

    source = HERE / f"{name}.c"
    headers = b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))  # vectors.h, blocks.h
    key = hashlib.sha256(
        source.read_bytes() + headers + " ".join(flags(name)).encode() + _cpu_identity().encode()
    ).hexdigest()[:16]
    out = cache_root() / "kernels" / f"{name}-{key}.so"
    try:
        if not out.is_file():
            _build(source, out, flags(name))
        return ctypes.CDLL(str(out))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning(
            "kernel unavailable, using torch",
            extra={"fields": {"kernel": name, "why": detail.strip()[:300]}},
        )
        return None


@functools.cache
def amx_usable(library_path: str, prefix: str) -> bool:
    """Whether a library's AMX tile path may run here: built in (`<prefix>_compiled()`: the
    compiler and the CPU have AMX), not switched off (PDSERVE_AMX=0), and a tile product
    (`<prefix>_probe()`) ran in a child process: a CPU can list AMX in its flags while the
    machine refuses it (an illegal instruction, seen on a Xeon VM)."""
    if os.environ.get("PDSERVE_AMX", "1") == "0":
        return False
    if not getattr(ctypes.CDLL(library_path), f"{prefix}_compiled")():
        return False
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL({library_path!r}).{prefix}_probe() != 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
