"""Keeping freed memory in the process, so a step's temporaries do not fault in fresh pages.

A forward pass allocates its activations anew each step (torch's CPU allocator asks malloc
for each tensor and gives it back when the tensor dies). glibc serves blocks above a size
threshold with mmap and returns a heap's free top to the kernel past a trim threshold; a
thread other than the main one allocates from an arena of 64 MB heaps, which it unmaps when
they empty. Either way the next step's tensors land on pages the kernel must fault in and
zero again: an engine stepping a DeepSeek-V3-shaped model (hidden 1,024, 32
experts) through 512-token prefill steps on a 2-core Zen 4, faulted ~100,000 pages (400 MB) a
step, 650-850 ms a step. Here the thresholds go up and every thread shares the main arena
(one heap, no size limit): 1,000-8,000 pages a step and 620-690 ms. vLLM's CPU guide gets
there by preloading tcmalloc.

The cost: a process keeps up to its largest step's temporaries after the step (and at most
TRIM_THRESHOLD of free heap), rather than handing them back between steps. PDSERVE_MALLOC=
default leaves glibc as it is (for a process that preloads another allocator, or to compare:
bench.offline reports the page faults a step). A worker calls it first thing, before its
model loads and its threads start; an Engine calls it too, for in-process use.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("pdserve.model")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the heaps
TRIM_THRESHOLD = 1 << 30  # free heap kept before any is returned


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process and put the threads it starts
    from now on in the main arena. False where the C library is not glibc (nothing done)."""
    if os.environ.get("PDSERVE_MALLOC") == "default":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    done = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done
    done = mallopt(M_ARENA_MAX, 1) == 1 and done
    log.debug("malloc thresholds raised", extra={"fields": {"done": done}})
    return done
