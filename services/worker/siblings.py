"""One command, a whole data-parallel group: a worker given `--data-parallel N` and no
`--data-parallel-address` (a container, a pod; `pdserve up` gives each rank its own process
and address instead) starts ranks 1..N-1 itself, as vLLM's `--data-parallel-size` does.

Rank r serves gRPC on port + r and its side door on metrics_port + r, so the router lists
HOST:port .. HOST:port+N-1 (each rank a target: docs/parallel.md); on GPUs, rank r takes
device base + r x M (M: --tensor-parallel, each rank's tensor ranks on the devices after its
own). The ranks die with this process (the kernel signals them), and this process leaves
service when one of them is lost (its next vote fails): the group restarts as one.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import subprocess

import torch

from services.launcher import PDSERVE, free_port, shared_host_env
from services.settings import Settings, child_env, env_name


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux only)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(settings: Settings, role: str) -> tuple[Settings, list[subprocess.Popen[bytes]]]:
    """This worker's settings as rank 0 of its group, and ranks 1..N-1 started (none where
    the group is one rank, or its address was given: the ranks were started elsewhere)."""
    w, ranks = settings.worker, settings.worker.data_parallel
    if ranks == 1 or w.data_parallel_address:
        return settings, []
    address = f"127.0.0.1:{free_port()}"
    base = {**os.environ, **child_env(settings, role)}
    base |= shared_host_env(base)  # the ranks share the host's cores (launcher.py)
    base[env_name("data_parallel_address")] = address
    siblings = []
    for r in range(1, ranks):
        env = {**base, env_name("data_parallel_rank"): str(r)}
        if w.metrics_port is not None:
            env[env_name("metrics_port")] = str(w.metrics_port + r)
        if (device := _device(settings, r)) is not None:
            env[env_name("device")] = device
        argv = [PDSERVE, role, "--host", settings.server.host, "--port", str(settings.port + r)]
        siblings.append(subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent))
    worker = dataclasses.replace(w, data_parallel_address=address)  # rank 0 (checked)
    return dataclasses.replace(settings, worker=worker), siblings


def _device(settings: Settings, rank: int) -> str | None:
    """Rank `rank`'s GPU (its tensor ranks take the ones after it); None on CPUs."""
    device = settings.model.device
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not cuda:
        return None
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank * settings.model.tensor_parallel}"
