"""`pdserve up`: the whole stack on one machine, as child processes of this one.

Starts the KV store (a redis-server child with `--redis`; otherwise the URL given, by default
the embedded `local://` store the workers share through files), `num_prefill` prefill,
`num_decode` decode and `num_encode` encode workers on free ports, and the router on
`--host`/`--port`. Waits until
the router's /health says 200, prints the URL and a ready line, and passes the children's
output through, each line prefixed with the child's name.

The store is private to the stack: a bare `local://` becomes a directory of this stack's own
(this user's, mode 0700, named after the stack's address, so a restart keeps its cache); the
redis-server child gets a random password and a memory cap (allkeys-lru) from a 0600 config
file, and the workers get its URL through their environment, never a command line. Blocks
are authenticated (kvstore/codec.py): without `--kv-key-file`, a key is made for the stack
and kept beside its local:// blocks (or, for another store, in the work directory).

A child that dies is reported and started again (same port) after a backoff that doubles
from 1 s to 30 s, and falls back to 1 s once a child has run for a minute. On SIGINT or
SIGTERM every child is stopped (router first, KV store last) and waited for; children also
get SIGTERM from the kernel if this process dies without cleaning up (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvstore import local
from kvstore.keyfile import make_key
from kvstore.store import redact
from services.launcher import PDSERVE, free_port, redis_conf, shared_host_env
from services.settings import Settings, SettingsError, check, child_env, env_name, names

BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0  # seconds of running that reset a child's backoff
READY_TIMEOUT = 600.0  # first start converts the model: minutes on a slow machine
_print_lock = threading.Lock()
COLOCATED_THRESHOLD = 1 << 30  # past any context window: no prompt goes to a prefill worker
# Below this many cores `up` colocates unless told otherwise: on 2 cores a prefill and a decode
# process, each computing on every core, slow each other down (OpenMP teams contending); one
# engine scheduling prompt chunks with its decodes gave 1.17x the tokens/s of one stream,
# 1.08x at 32 streams and 1.7x the goodput at 1 req/s (docs/benchmarks.md, "Serving against
# vLLM"). Not measured between 2 and 8 cores: there, say --no-colocated or --colocated.
COLOCATE_BELOW_CORES = 8
USAGE_ERROR = 2  # the exit code of `pdserve` refusing a setting or a model (services/cli.py)


def say(line: str) -> None:
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux only)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff: float = 1.0
    restart_at: float | None = None
    ever_ready: bool = False  # running when the stack first answered ready
    last_line: str = ""  # of its output (a usage error's message)
    pump: threading.Thread | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.started = time.monotonic()
        self.restart_at = None
        self.pump = threading.Thread(target=self._pump, args=(self.process,), daemon=True)
        self.pump.start()
        say(f"pdserve: {self.name} started (pid {self.process.pid})")

    def _pump(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            self.last_line = raw.decode(errors="replace").rstrip()
            say(f"{self.name} | {self.last_line}")

    def stop(self, timeout: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Stack:
    settings: Settings
    children: list[Child] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))

    @property
    def colocated(self) -> bool:
        """As set; unset, colocated on a host with few cores, unless prefill workers were
        asked for by number."""
        u = self.settings.up
        if u.colocated is not None:
            return u.colocated
        return self.cores < COLOCATE_BELOW_CORES and u.num_prefill == 1

    @property
    def url(self) -> str:
        return f"http://{self.settings.server.host}:{self.settings.port}"

    def topology(self) -> str:
        u, ranks = self.settings.up, self.settings.worker.data_parallel
        if ranks > 1:
            roles = "decode" if self.colocated else f"prefill x{u.num_prefill}, decode"
            return f"{roles} x{u.num_decode}, each {ranks} data-parallel ranks"
        encoders = f", encode x{u.num_encode}" if u.num_encode else ""
        if not self.colocated:
            return f"prefill x{u.num_prefill}, decode x{u.num_decode}{encoders}"
        shape = f"colocated: decode x{u.num_decode} computing prompts too{encoders}"
        if u.colocated is None:
            shape += (
                f" (chosen for {self.cores} cores: faster than prefill and decode "
                "processes sharing them; --no-colocated to run prefill workers)"
            )
        return shape

    def build(self, workdir: Path) -> str:
        """The children to run (not started); returns the KV store URL the workers use."""
        s = self.settings
        # settings reach the children as this process resolved them; other PDSERVE_*
        # variables (PDSERVE_CACHE_DIR, PDSERVE_KERNELS) pass through
        ours = {env_name(n) for n in names()} | {"PDSERVE_CONFIG"}
        base = {k: v for k, v in os.environ.items() if k not in ours}
        store = self._redis(workdir, base) if s.up.redis else self._local_store()
        key_file = s.store.kv_key_file or str(self._key_file(store, workdir))
        secrets_env = {
            env_name("kv_store"): store, env_name("kv_key_file"): key_file,
        }  # fmt: skip
        roles = (
            (("decode", s.up.num_decode),)
            if self.colocated
            else (("prefill", s.up.num_prefill), ("decode", s.up.num_decode))
        )
        shared = sum(count for _, count in roles) * s.worker.data_parallel > 1
        shared_cores = shared_host_env(base) if shared else {}
        addresses: dict[str, list[str]] = {"prefill": [], "decode": [], "encode": []}
        workers: list[Child] = []
        ranks = s.worker.data_parallel  # each worker N processes, each its own target
        meeting = 0
        for role, count in roles:
            for i in range(count * ranks):
                port = free_port()
                env = {**base, **child_env(s, role), **secrets_env, **shared_cores}
                if ranks > 1:  # rank 0 of each group hosts the group's meeting point
                    if i % ranks == 0:
                        meeting = free_port()
                    env[env_name("data_parallel_rank")] = str(i % ranks)
                    env[env_name("data_parallel_address")] = f"127.0.0.1:{meeting}"
                metrics_port = (
                    s.worker.metrics_port
                )  # one port each: prefill workers', then decode's
                if metrics_port is not None:
                    env[env_name("metrics_port")] = str(metrics_port + len(workers))
                argv = [PDSERVE, role, "--host", "127.0.0.1", "--port", str(port)]
                workers.append(Child(f"{role}-{i}", argv, env))
                addresses[role].append(f"127.0.0.1:{port}")
        for i in range(s.up.num_encode):
            port = free_port()
            env = {**base, **child_env(s, "encode"), **secrets_env}
            argv = [PDSERVE, "encode", "--host", "127.0.0.1", "--port", str(port)]
            workers.append(Child(f"encode-{i}", argv, env))
            addresses["encode"].append(f"127.0.0.1:{port}")
        self.children += workers
        env = {**base, **child_env(s, "router")}
        if self.colocated:  # the router sends every prompt to a decode worker
            env[env_name("disagg_threshold")] = str(COLOCATED_THRESHOLD)
        argv = [PDSERVE, "router", "--host", s.server.host, "--port", str(s.port),
                "--prefill", ",".join(addresses["prefill"]) or "",
                "--decode", ",".join(addresses["decode"]),
                "--encode", ",".join(addresses["encode"]) or ""]  # fmt: skip
        self.children.append(Child("router", argv, env))
        return store

    @property
    def stack_dir(self) -> Path:
        """This stack's own local:// directory: this user's, named after the stack's address
        (two stacks on one host never share one; a restart of the same stack keeps it)."""
        address = f"{self.settings.server.host}-{self.settings.port}"
        return local.default_dir() / f"up-{re.sub(r'[^A-Za-z0-9.-]', '_', address)}"

    def _local_store(self) -> str:
        """The workers' store URL: a bare local:// made the stack's own, others as given."""
        if self.settings.store.kv_store != "local://":
            return self.settings.store.kv_store
        try:
            local.private_dir(local.default_dir())
            return f"local://{local.private_dir(self.stack_dir)}"
        except OSError as e:
            raise SettingsError(f"kv_store local://: {e}") from e

    def _key_file(self, store: str, workdir: Path) -> Path:
        """A key made for the stack: kept beside its local:// blocks (they live and go
        together), else for this run only, in the work directory."""
        try:
            if not store.startswith("local:"):
                say(
                    "pdserve: KV blocks are authenticated with a key made for this run: give "
                    "--kv-key-file to keep them across restarts or share the store"
                )
                return make_key(workdir / "kv.key")
            return make_key(local.private_dir(local.path_of(store)) / "kv.key")
        except (OSError, ValueError) as e:
            raise SettingsError(f"the stack's KV key: {e}") from e

    def _redis(self, workdir: Path, env: dict[str, str]) -> str:
        """A redis-server child with a password and a memory cap; the workers' store URL."""
        cap = self.settings.up.redis_max_memory  # checked (services/settings/checks.py)
        port, password = free_port(), secrets.token_urlsafe(32)
        conf = redis_conf(workdir / "redis.conf", port, workdir, password, cap)
        self.children.append(Child("redis", ["redis-server", str(conf)], env))
        return f"redis://:{password}@127.0.0.1:{port}/0"

    def supervise_once(self) -> None:
        """Report children that died; start again those whose backoff has passed. A child
        that refused its settings before it was ever ready is not restarted: SettingsError
        with its message (a restart would refuse them again)."""
        now = time.monotonic()
        for child in self.children:
            if child.process is None:
                continue
            code = child.process.poll()
            if code == USAGE_ERROR and not child.ever_ready:
                if child.pump is not None:
                    child.pump.join(timeout=1)  # its last words
                raise SettingsError(f"{child.name} refused its settings: {child.last_line}")
            if code is not None and child.restart_at is None:
                if now - child.started > STABLE_AFTER:
                    child.backoff = 1.0
                child.restart_at = now + child.backoff
                say(
                    f"pdserve: {child.name} exited with code {code}; "
                    f"restarting in {child.backoff:.0f}s"
                )
                child.backoff = min(BACKOFF_MAX, child.backoff * 2)
            elif child.restart_at is not None and now >= child.restart_at:
                child.start()

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT
        while not self.stopping.is_set() and time.monotonic() < deadline:
            self.supervise_once()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    for child in self.children:
                        child.ever_ready = child.process is not None and child.restart_at is None
                    return True
            except httpx.HTTPError:
                pass
            self.stopping.wait(0.25)
        return False

    def stop(self) -> None:
        order = sorted(self.children, key=lambda c: {"router": 0, "redis": 2}.get(c.name, 1))
        for child in order:
            child.stop(self.settings.worker.grace_period + 5)


def up(settings: Settings) -> int:
    """Run the stack until SIGINT or SIGTERM. Every role's settings are checked here first
    (the model's architecture included; a GGUF converted once, not in every worker at once):
    SettingsError or ModelLoadError, and no child started, when one is wrong."""
    say(f"pdserve: preparing the model ({settings.model.model})")
    check(settings)  # the children get `settings` as given: each reads its own secret files
    stack = Stack(settings)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stack.stopping.set())
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))  # 0700, a name no one can guess
    try:
        store = stack.build(workdir)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    shown = redact(store)
    for child in stack.children:
        child.start()
    try:
        if stack.wait_ready():
            say(
                f"pdserve: ready at {stack.url}/v1 ({stack.topology()}, KV store {shown}); "
                "Ctrl-C stops"
            )
        elif not stack.stopping.is_set():
            say(f"pdserve: error: not healthy within {READY_TIMEOUT:.0f}s; stopping")
            return 1
        while not stack.stopping.is_set():
            stack.supervise_once()
            stack.stopping.wait(0.25)
        say("pdserve: stopping")
        return 0
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
