"""Starting pdserve's processes as children: workers and a redis-server, on free ports.

Used by tests, benchmarks and `pdserve up`: a child is a command, a log file, and a way to
know it is ready.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from services.settings import DEFAULTS

PDSERVE = str(Path(sys.executable).parent / "pdserve")

# The workers share the host's cores. Between parallel regions libgomp spins its threads
# 300,000 times by default (milliseconds): a busy worker's spinning threads then take the cores
# the other one needs. Measured on 2 cores (1 prefill + 1 decode, bf16, fresh prompts, tok/s
# with 1 stream / with 32): default 47.9 / 136, 20,000 44.8 / 173, 4,000 45.5 / 221,
# 1,000 42.8 / 261, 300 37.1 / 251, passive (0) 28.6 / 252. A user's own setting wins.
SHARED_HOST_SPIN = "1000"
SPIN_VARIABLES = {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"}


def shared_host_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a worker sharing the host's cores with others adds to `env`: nothing where the
    user set OpenMP's waiting already."""
    return {"GOMP_SPINCOUNT": SHARED_HOST_SPIN} if SPIN_VARIABLES.isdisjoint(env) else {}


_GIVEN: set[int] = set()  # ports free_port handed out in this process


def free_port() -> int:
    """A port nothing listens on now, and not one this process handed out before: the kernel
    can offer a just-closed ephemeral port again, and two workers given one port would both
    bind it (gRPC servers set SO_REUSEPORT) and split its connections between them."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def wait_for_port(port: int, timeout: float = 10.0, address: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listened on {address}:{port} within {timeout}s")


def redis_conf(
    path: Path, port: int, workdir: Path, password: str | None = None, max_memory: str | None = None
) -> Path:
    """Write a redis-server config (mode 0600: it may hold the password) and return its path.

    Nothing persisted; with `max_memory`, least recently used keys are evicted past it (a KV
    block can always be recomputed). The password goes in this file, never on a command line
    (visible to every user in `ps`)."""
    lines = [f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no",
             f"dir {_quote(str(workdir))}"]  # fmt: skip
    if password is not None:
        lines.append(f"requirepass {_quote(password)}")
    if max_memory is not None:
        lines += [f"maxmemory {max_memory}", "maxmemory-policy allkeys-lru"]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # also if the file was there before
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _quote(text: str) -> str:
    """A redis.conf string argument."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def start_redis(
    workdir: Path, port: int | None = None, password: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server child that keeps nothing on disk; its URL (with the password, if any)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    conf = redis_conf(workdir / "redis.conf", port, workdir, password)
    proc = subprocess.Popen(
        [binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_port(port)
    auth = f":{quote(password, safe='')}@" if password is not None else ""
    return proc, f"redis://{auth}127.0.0.1:{port}/0"


class Child:
    """A child process of ours; stop() signals it and waits (kills it after `timeout`)."""

    process: subprocess.Popen[bytes] | None = None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process is None:
            return 0
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.process = None
        return code


class WorkerProcess(Child):
    """`pdserve prefill|decode|encode` as a child process, ready once its Health says so."""

    def __init__(
        self,
        role: str,
        model: str,
        kv_store: str,
        log_dir: Path,
        *args: str,
        dtype: str = DEFAULTS.model.dtype,
    ) -> None:
        self.role = role
        self.port = free_port()
        self.log_path = log_dir / f"{role}-{self.port}.log"
        self.command = [
            PDSERVE, role, "--port", str(self.port), "--model", model, "--dtype", dtype,
            "--device", "cpu", "--kv-store", kv_store, *args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> WorkerProcess:
        return self.launch().wait_ready(timeout)

    def launch(self) -> WorkerProcess:
        """Start the process and return at once (wait_ready() waits for it)."""
        env = dict(os.environ, PDSERVE_LOG_LEVEL=os.environ.get("PDSERVE_LOG_LEVEL", "info"))
        env.update(shared_host_env(env))  # tests and benchmarks start several on one host
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log, env=env)
        return self

    def wait_ready(self, timeout: float = 120) -> WorkerProcess:
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} exited: {self.log_path.read_text()[-2000:]}")
            if asyncio.run(self.healthy()):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"{self.role} not ready in {timeout}s: {self.log_path.read_text()}")

    async def healthy(self) -> bool:
        import grpc

        from services.rpc import worker_pb2 as pb
        from services.rpc import worker_pb2_grpc as pbg

        async with grpc.aio.insecure_channel(self.address) as channel:
            stubs: dict[str, Any] = {"prefill": pbg.PrefillWorkerStub,
                                     "encode": pbg.EncodeWorkerStub}  # fmt: skip
            stub_class = stubs.get(self.role, pbg.DecodeWorkerStub)
            try:
                reply = await stub_class(channel).Health(pb.HealthRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                return False
            return bool(reply.ready)


class RouterProcess(Child):
    """`pdserve router` as a child process, in front of the given workers."""

    def __init__(
        self,
        log_dir: Path,
        prefill: list[str],
        decode: list[str],
        *args: str,
        model: str = DEFAULTS.model.model,
    ) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"router-{self.port}.log"
        self.command = [
            PDSERVE, "router", "--port", str(self.port), "--model", model,
            *(f"--prefill={a}" for a in prefill), *(f"--decode={a}" for a in decode), *args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, healthy: bool = True, timeout: float = 60) -> RouterProcess:
        """Start; return once it listens (and, with `healthy`, once /health says 200)."""
        import httpx

        env = dict(os.environ, PDSERVE_LOG_LEVEL=os.environ.get("PDSERVE_LOG_LEVEL", "info"))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited: {self.log_path.read_text()[-2000:]}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=1).status_code
            except httpx.TransportError:
                status = 0
            if status == 200 or (status and not healthy):
                return self
            time.sleep(0.1)
        raise RuntimeError(f"router not ready in {timeout}s: {self.log_path.read_text()}")
