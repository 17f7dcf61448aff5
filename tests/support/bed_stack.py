"""pdserve on the multi-host bed (tests/support/netbed.py): a redis-server, prefill and decode
workers and a router, each on a host of its own, started as children of this process.

    with Bed(HOSTS) as bed:
        stack = BedStack(bed, model_dir, logs).start(2, 2, router_args=[...])
        stack.router.url  # the API, reached through the bridge
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from services.launcher import Child, RouterProcess, WorkerProcess, wait_for_port
from tests.support.netbed import Bed

REDIS_PORT = 6379
HOSTS = ["router", "redis", "p0", "p1", "d0", "d1"]


class BedWorker(WorkerProcess):
    """A worker on a bed host, listening on the host's address."""

    def __init__(
        self,
        bed: Bed,
        host: str,
        role: str,
        model: str,
        store: str,
        logs: Path,
        *args: str,
        dtype: str = "float32",
    ) -> None:
        super().__init__(role, model, store, logs, *args, dtype=dtype)
        self.host, self.ip = host, bed.address(host)
        self.log_path = logs / f"{role}-{host}.log"
        self.command = [*bed.exec(host), *self.command, "--host", self.ip]

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"


class BedRouter(RouterProcess):
    def __init__(
        self, bed: Bed, logs: Path, prefill: list[str], decode: list[str], *args: str
    ) -> None:
        super().__init__(logs, prefill, decode, *args)
        self.ip = bed.address("router")
        self.command = [*bed.exec("router"), *self.command, "--host", self.ip]

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


class BedRedis(Child):
    """A redis-server on the `redis` host, keeping nothing on disk."""

    def __init__(self, bed: Bed, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.ip = bed.address("redis")
        workdir.mkdir(parents=True, exist_ok=True)
        self.command = [*bed.exec("redis"), binary, "--bind", self.ip, "--port", str(REDIS_PORT),
                        "--save", "", "--appendonly", "no", "--protected-mode", "no",
                        "--dir", str(workdir)]  # fmt: skip
        self.url = f"redis://{self.ip}:{REDIS_PORT}/0"

    def start(self) -> BedRedis:
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_port(REDIS_PORT, address=self.ip)
        return self


class BedStack:
    def __init__(self, bed: Bed, model: str, logs: Path) -> None:
        self.bed, self.model, self.logs = bed, model, logs
        self.redis = BedRedis(bed, logs / "redis")
        self.prefill: list[BedWorker] = []
        self.decode: list[BedWorker] = []
        self.router: BedRouter | None = None

    def start(
        self, prefill: int, decode: int, worker_args: list[str], router_args: list[str]
    ) -> BedStack:
        """Redis, `prefill` workers on p0.., `decode` on d0.., then the router; stopped
        again if any fails to start."""
        try:
            self.redis.start()
            self.prefill = [self._worker(f"p{i}", "prefill", worker_args) for i in range(prefill)]
            self.decode = [self._worker(f"d{i}", "decode", worker_args) for i in range(decode)]
            for w in self.workers:
                w.launch()
            for w in self.workers:
                w.wait_ready(300)
            self.router = BedRouter(
                self.bed,
                self.logs,
                [w.address for w in self.prefill],
                [w.address for w in self.decode],
                *router_args,
            )
            self.router.start(timeout=120)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def workers(self) -> list[BedWorker]:
        return [*self.prefill, *self.decode]

    def _worker(self, host: str, role: str, args: list[str]) -> BedWorker:
        return BedWorker(self.bed, host, role, self.model, self.redis.url, self.logs, *args)

    def stop(self) -> None:
        for child in (self.router, *self.workers, self.redis):
            if child is not None:
                child.stop(timeout=10)
