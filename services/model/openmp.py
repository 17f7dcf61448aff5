"""Which thread owns OpenMP's worker threads.

torch's CPU ops (oneDNN's products among them) and our C kernels run their parallel regions
on GNU OpenMP (libgomp): each thread that starts a parallel region becomes the master of a
team of its own, and its team's threads stay for the life of that thread. libgomp lets those
threads spin between regions (cheap hand-offs, a few microseconds) only while it manages no
more threads than there are CPUs; past that it puts them to sleep at once, and every region
then pays a futex wake-up. A worker loads its model on the main thread (a team) and steps the
engine on another (a second team): on 2 cores that made 4 managed threads, 12,000 context
switches per 40 decode steps instead of 150, and a batch-1 step of 28 ms instead of 19.

So a service that hands its model to another thread releases the loading thread's team
first; from then on, parallel work happens on the engine thread only.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("pdserve.model")
PAUSE_SOFT = 1  # omp_pause_soft: free the threads, keep nothing that must be rebuilt


def release_this_threads_team() -> bool:
    """Free the OpenMP team of the calling thread (a later parallel region there builds a
    new one). False where the runtime is not libgomp >= 9 (nothing done)."""
    import torch  # noqa: F401  (loads torch's libgomp first: the soname finds that copy)

    try:
        runtime = ctypes.CDLL("libgomp.so.1")
        pause = runtime.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int]
    released = pause(PAUSE_SOFT) == 0
    log.debug("openmp team released", extra={"fields": {"released": released}})
    return released
