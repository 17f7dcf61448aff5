"""How a worker's processes meet: one torch.distributed group (gloo on CPUs, NCCL on GPUs),
made directly from a rendezvous store rather than through torch's global default group, so
that one process can belong to several (its tensor ranks, its column of data-parallel ranks).

Gloo listens on the address this process reaches the store's host from: the one its hostname
resolves to may be out of the others' reach (a network namespace, a container whose hostname
names a loopback address), and ranks of one worker may be on several hosts. GLOO_SOCKET_IFNAME
names an interface instead, as torch users expect.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

Group = Any  # a torch.distributed backend made directly: ProcessGroupGloo or ProcessGroupNCCL


def connect(
    host: str,
    port: int,
    rank: int,
    ranks: int,
    device: torch.device,
    timeout: float = 3600.0,
    check: Callable[[], None] = lambda: None,
    hosts: bool | None = None,
    prefix: str = "",
) -> Group:
    """Join the group (rank 0 hosts its rendezvous store at host:port, or the process told
    it `hosts`; groups meeting at one store each have a `prefix`) within `timeout` seconds
    (ranks load the model first). `check` runs every half second while rank 0 waits for the
    others, to raise if one has died."""
    from torch.distributed import PrefixStore, TCPStore

    limit = datetime.timedelta(seconds=timeout)
    hosts = rank == 0 if hosts is None else hosts
    store: Any = TCPStore(host, port, ranks, hosts, limit, wait_for_workers=False)
    if prefix:
        store = PrefixStore(prefix, store)
    # no timeout on the exchanges: a rank waits for rank 0's next command as long as it is
    # idle; a rank or rank 0 that dies closes its sockets (and ranks watch their parent)
    forever = datetime.timedelta(days=365)
    made: list[Group | BaseException] = []

    def make() -> None:
        try:
            made.append(_group(store, rank, ranks, device, forever, host, port))
        except BaseException as e:
            made.append(e)

    joiner = threading.Thread(target=make, name="group-join", daemon=True)
    joiner.start()
    while joiner.is_alive():
        joiner.join(0.5)
        check()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _group(
    store: Any, rank: int, ranks: int, device: torch.device, forever: datetime.timedelta,
    host: str, port: int,
) -> Group:  # fmt: skip
    dist = torch.distributed
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = forever
        return dist.ProcessGroupNCCL(store, rank, ranks, nccl)
    address = None if os.environ.get("GLOO_SOCKET_IFNAME") else local_address(host, port)
    if address is None:
        return dist.ProcessGroupGloo(store, rank, ranks, forever)
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo._timeout = forever
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, ranks, gloo)


def local_address(host: str, port: int) -> str | None:
    """This host's address on the route to host:port (None: no IPv4 route, or no such
    host): a UDP socket's connect sends nothing, it only picks the route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return None


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a group loads (the model as rank 0 loaded it), and how many ranks;
    the command-line arguments that tell a rank process so."""

    model: str
    dtype: str
    device: str
    kernels: str
    ranks: int

    def args(self) -> list[str]:
        return [
            "--model", self.model, "--dtype", self.dtype, "--device", self.device,
            "--kernels", self.kernels, "--ranks", str(self.ranks),
        ]  # fmt: skip


class RankProcesses:
    """Ranks 1..N-1 of a group this process (rank 0) starts: `python -m MODULE ARGS --port P
    --threads T --rank r` each. What they are ("tensor", "expert") names them in errors."""

    def __init__(self, module: str, args: list[str], ranks: int, threads: int, what: str) -> None:
        from services.launcher import free_port

        self.what, self.port = what, free_port()
        command = [sys.executable, "-m", module, *args]
        command += ["--port", str(self.port), "--threads", str(threads), "--rank"]
        self.processes = [subprocess.Popen([*command, str(r)]) for r in range(1, ranks)]

    def join(self, model: str, ranks: int, device: torch.device, timeout: float) -> Group:
        """The group with them (ModelLoadError where one exits first; all killed on failure)."""
        from services.model.errors import ModelLoadError

        def check() -> None:
            why = self.exited()
            if why is not None:
                raise ModelLoadError(model, why)

        try:
            return connect("127.0.0.1", self.port, 0, ranks, device, timeout, check)
        except BaseException:
            for proc in self.processes:
                proc.kill()
            raise

    def exited(self) -> str | None:
        """Why the group cannot serve, where a rank process has exited."""
        for r, proc in enumerate(self.processes, start=1):
            if proc.poll() is not None:
                return f"{self.what} rank {r} exited with code {proc.returncode}"
        return None

    def wait(self, timeout: float, kill: bool) -> None:
        """Wait for them to exit (killed past `timeout`, or at once with `kill`)."""
        for proc in self.processes:
            if kill:
                proc.kill()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A GPU each (cuda:i + rank); one CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def exit_with_parent() -> None:
    """Exit as soon as rank 0's process is gone, whatever this one is doing (loading, joining,
    serving): a rank alone serves nothing."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@contextlib.contextmanager
def lost_on_failure() -> Iterator[None]:
    """A collective's failure as DataRankLost: a peer closed its end, or timed out (gloo's or
    NCCL's RuntimeError); the ranks cannot step on without it."""
    from services.model.errors import DataRankLost

    try:
        yield
    except RuntimeError as e:
        raise DataRankLost(f"{type(e).__name__}: {e}") from e
