"""Real redis-server processes for tests: a standalone server and a 3-node cluster, each on
free ports, started and stopped by the test session."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

INSTALL_HINT = (
    "redis-server is not installed: the KV store tests need a real Redis "
    "(Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis)"
)


def require_binaries() -> tuple[str, str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    return server, cli


def free_port(also_free: int = 0) -> int:
    """A port free now (and, if asked, free at port + also_free: a cluster's bus port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if also_free == 0 or port + also_free > 65535:
            if also_free == 0:
                return port
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + also_free))
            except OSError:
                continue
        return port


def _wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"redis-server did not listen on {port} within {timeout}s")


def _wait_for_path(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not create {path} within {timeout}s")
        time.sleep(0.02)


class RedisServer:
    """One redis-server child: nothing persisted, killable and restartable on its port."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        extra: tuple[str, ...] = (),
        listen_port: int | None = None,
        unix_socket: Path | None = None,
    ) -> None:
        """`extra`: more redis-server options; `listen_port`: the port to wait for when it is
        not `port` (a TLS port, with the plain one off); `unix_socket`: listen there too."""
        self.binary, self.cli = require_binaries()
        self.port = free_port() if port is None else port
        self.listen_port = listen_port
        self.unix_socket = unix_socket
        if unix_socket is not None:
            extra = (*extra, "--unixsocket", str(unix_socket))
        self.workdir = workdir
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), *self.extra]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.unix_socket is not None:
            _wait_for_path(self.unix_socket)
        else:
            _wait_for_port(self.listen_port or self.port)
        return self

    def kill(self) -> None:
        """SIGKILL: connections drop at once, as when a machine dies."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def redis_cli(self, *args: str) -> str:
        command = [self.cli, "-p", str(self.port), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout


class RedisClusterServers:
    """Three cluster-enabled redis-servers joined into one cluster (no replicas)."""

    def __init__(self, workdir: Path) -> None:
        options = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        self.nodes = [
            RedisServer(workdir / f"node{i}", free_port(also_free=10000), options) for i in range(3)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        created = subprocess.run(
            [self.nodes[0].cli, "--cluster", "create", *addresses, "--cluster-replicas", "0",
             "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {created.stdout}{created.stderr}"
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.redis_cli("cluster", "info") for n in self.nodes):
                return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
