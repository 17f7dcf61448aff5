"""Real redis-server processes for tests: a standalone server (optionally with a password,
ACL users and TLS) and a 3-node cluster, each on free ports, started and stopped by the test
session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

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


@dataclass(frozen=True)
class TLSFiles:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, all
    signed by the CA (openssl CLI)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, directory: Path) -> TLSFiles:
        if shutil.which("openssl") is None:
            pytest.skip("the openssl command is not installed: no certificates for the TLS test")
        directory.mkdir(parents=True, exist_ok=True)
        d = directory

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                "-subj", "/CN=pdserve test CA", "-keyout", str(d / "ca.key"),
                "-out", str(d / "ca.crt"))  # fmt: skip
        ext = d / "server.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")
        for name, subject, extra in (
            ("server", "/CN=127.0.0.1", ["-extfile", str(ext)]),
            ("client", "/CN=pdserve worker", []),
        ):
            openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
                    "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))  # fmt: skip
            openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"),
                    "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "1",
                    "-out", str(d / f"{name}.crt"), *extra)  # fmt: skip
        return cls(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt",
                   d / "client.key")  # fmt: skip


@dataclass(frozen=True)
class ACLUser:
    """An ACL user: `rules` as redis-server's --user takes them (key patterns, commands); by
    default what a worker needs and no more (docs/configuration.md: pdserve's keys, GET SET
    EXISTS DEL)."""

    name: str
    password: str
    rules: tuple[str, ...] = ("~pdserve:*", "+get", "+set", "+exists", "+del")


MAX_MEMORY = "1gb"


class RedisServer:
    """One redis-server child: nothing persisted, killable and restartable on its port."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        extra: tuple[str, ...] = (),
        listen_port: int | None = None,
        unix_socket: Path | None = None,
        password: str | None = None,
        users: Sequence[ACLUser] = (),
        tls: TLSFiles | None = None,
    ) -> None:
        """`extra`: more redis-server options; `listen_port`: the port to wait for when it is
        not `port`; `unix_socket`: listen there too; `password`: the default user's (AUTH);
        `users`: ACL users; `tls`: serve TLS only (clients must show a certificate)."""
        self.binary, self.cli = require_binaries()
        self.password = password
        self.tls = tls
        if tls is not None:
            port, listen_port = 0, free_port()  # the plain port off
            extra = (*extra, "--tls-port", str(listen_port), "--tls-cert-file",
                     str(tls.server_cert), "--tls-key-file", str(tls.server_key),
                     "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "yes")  # fmt: skip
        if password is not None:
            extra = (*extra, "--requirepass", password)
        for user in users:
            extra = (*extra, "--user", user.name, "on", f">{user.password}", *user.rules)
        self.port = free_port() if port is None else port
        self.listen_port = listen_port
        self.unix_socket = unix_socket
        if unix_socket is not None:
            extra = (*extra, "--unixsocket", str(unix_socket))
        self.workdir = workdir
        self.extra = extra
        self.log_path = workdir / "redis-server.log"
        self.process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """The URL a client uses, with the default user's password if it has one."""
        return self.url_for(None, self.password)

    def url_for(self, user: str | None, password: str | None) -> str:
        auth = ""
        if user is not None or password is not None:
            auth = f"{quote(user or '', safe='')}:{quote(password or '', safe='')}@"
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        t = self.tls
        return (
            f"rediss://{auth}127.0.0.1:{self.listen_port}/0?ssl_ca_certs={t.ca}"
            f"&ssl_certfile={t.client_cert}&ssl_keyfile={t.client_key}"
        )

    def start(self) -> RedisServer:
        """Start; RuntimeError with the server's log if it does not come up."""
        # capped as a deployment's is (`pdserve up --redis`: 2gb): the session's server takes
        # every block the suite's workers write, 5.7 GB by half-way uncapped (a CI run was
        # killed for memory); a test's own --maxmemory comes later and wins
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--maxmemory", MAX_MEMORY,
                "--maxmemory-policy", "allkeys-lru", *self.extra]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=log)
        try:
            if self.unix_socket is not None:
                _wait_for_path(self.unix_socket)
            else:
                _wait_for_port(self.listen_port or self.port)
        except RuntimeError as e:
            self.kill()
            raise RuntimeError(f"{e}; its log:\n{self.log_path.read_text()[-2000:]}") from e
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
        """redis-cli against this server as its default user (the password through the
        environment, as REDISCLI_AUTH, not on the command line)."""
        command = [self.cli, "-p", str(self.listen_port or self.port)]
        if self.tls is not None:
            command += ["--tls", "--cacert", str(self.tls.ca), "--cert",
                        str(self.tls.client_cert), "--key", str(self.tls.client_key)]  # fmt: skip
        env = dict(os.environ)
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password
        out = subprocess.run([*command, *args], capture_output=True, text=True, timeout=30, env=env)
        return out.stdout


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
            [
                self.nodes[0].cli,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
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
