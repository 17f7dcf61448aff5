"""A container engine for `make test-deploy`: found running, or installed and started (and
then stopped by whoever started it); the base images the Dockerfile and compose file name,
pulled or built locally from a Debian root file system (no registry is reachable on the CI
machines); compose v2 as a CLI plugin where the host has none; and the
offline wheelhouse the Dockerfile installs from (`make wheels`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGES = ("python:3.11-slim-bookworm", "redis:7-alpine")
# what the Debian base must hold: Python 3.11 with venv for the image, redis for the store
BASE_PACKAGES = "python3,python3-venv,redis-server,ca-certificates"
CACHE = Path(os.environ.get("PDSERVE_DEPLOY_CACHE", Path.home() / ".cache" / "pdserve-deploy"))


class Unavailable(Exception):
    """No container engine can run here: why, and what was tried."""


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 1800, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, env=env, timeout=timeout, check=check, capture_output=True, text=True
    )


@dataclass
class Engine:
    """The docker CLI's environment (DOCKER_CONFIG with the compose plugin), and the daemon
    this run started, if it started one."""

    env: dict[str, str]
    started: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    notes: list[str] = field(default_factory=list)

    def docker(self, *args: str, timeout: float = 1800, check: bool = True) -> str:
        done = subprocess.run(
            ["docker", *args], env=self.env, timeout=timeout, capture_output=True, text=True
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {done.stderr[-3000:]}")
        return done.stdout

    def ok(self, *args: str, timeout: float = 120) -> bool:
        done = subprocess.run(["docker", *args], env=self.env, timeout=timeout, capture_output=True)
        return done.returncode == 0

    def stop(self) -> None:
        """Stop the daemon this run started (by its pid, never by name)."""
        if self.started is not None and self.started.poll() is None:
            self.started.terminate()
            try:
                self.started.wait(60)
            except subprocess.TimeoutExpired:
                self.started.kill()
                self.started.wait()


def daemon_answers(env: dict[str, str]) -> bool:
    if shutil.which("docker") is None:
        return False
    return (
        subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0
    )


def apt_install(*packages: str) -> None:
    run("apt-get", "update", "-qq", timeout=600)
    run(
        "apt-get",
        "install",
        "-y",
        "-qq",
        *packages,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        timeout=1200,
    )


def start_engine(work: Path) -> Engine:
    """A daemon that answers: the one running, or one installed and started here."""
    config = work / "docker-config"
    (config / "cli-plugins").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DOCKER_CONFIG": str(config)}
    engine = Engine(env)
    if daemon_answers(env):
        return engine
    tried = []
    if shutil.which("dockerd") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise Unavailable("no dockerd, and apt-get as root is not available to install one")
        try:
            apt_install("docker.io")
            tried.append("installed docker.io")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"apt-get install docker.io failed: {e}") from e
    if os.geteuid() != 0:
        raise Unavailable("dockerd is installed but no daemon answers, and only root starts one")
    engine.log = work / "dockerd.log"
    with open(engine.log, "wb") as log:
        engine.started = subprocess.Popen(
            ["dockerd"], stdout=log, stderr=log, start_new_session=True
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if daemon_answers(env):
            engine.notes.append("started dockerd")
            return engine
        if engine.started.poll() is not None:
            break
        time.sleep(1)
    engine.stop()
    raise Unavailable(
        f"dockerd did not start ({', '.join(tried) or 'found installed'}): "
        f"{engine.log.read_text()[-500:]}"
    )


def ensure_compose(engine: Engine) -> None:
    """`docker compose` (v2): the host's, or Debian trixie's plugin fetched without touching
    the system's apt sources."""
    if run("docker", "compose", "version", env=engine.env, check=False).returncode == 0:
        return
    trixie = CACHE / "trixie"
    for d in ("lists/partial", "cache/archives/partial", "etc", "debs", "x"):
        (trixie / d).mkdir(parents=True, exist_ok=True)
    (trixie / "etc" / "sources.list").write_text("deb http://deb.debian.org/debian trixie main\n")
    apt = ["apt-get", "-o", f"Dir::Etc::SourceList={trixie}/etc/sources.list",
           "-o", "Dir::Etc::SourceParts=/dev/null", "-o", f"Dir::State::Lists={trixie}/lists",
           "-o", f"Dir::Cache={trixie}/cache"]  # fmt: skip
    run(*apt, "update", "-qq", timeout=600)
    subprocess.run(
        [*apt, "download", "docker-compose", "docker-buildx"],
        cwd=trixie / "debs",
        check=True,
        capture_output=True,
        timeout=600,
    )
    for deb in (trixie / "debs").glob("*.deb"):
        run("dpkg-deb", "-x", str(deb), str(trixie / "x"))
    plugins = Path(engine.env["DOCKER_CONFIG"]) / "cli-plugins"
    for plugin in (trixie / "x" / "usr/libexec/docker/cli-plugins").iterdir():
        shutil.copy2(plugin, plugins / plugin.name)
    run("docker", "compose", "version", env=engine.env)
    engine.notes.append("compose v2 plugin from Debian trixie")


def debian_mirror() -> str:
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        text = path.read_text() if path.is_file() else ""
        for word in text.split():
            if "debian.org/debian" in word and "security" not in word:
                return word
    return "http://deb.debian.org/debian"


def ensure_base_images(engine: Engine) -> None:
    """The images FROM and `image:` name: present, pulled, or imported from a Debian root
    file system under the same names (Debian bookworm's python3 is 3.11)."""
    missing = [i for i in BASE_IMAGES if not engine.ok("image", "inspect", i)]
    missing = [i for i in missing if not engine.ok("pull", i)]
    if not missing:
        return
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    with tempfile.TemporaryDirectory(dir=CACHE.parent if CACHE.parent.exists() else None) as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(
            "debootstrap",
            "--variant=minbase",
            f"--include={BASE_PACKAGES}",
            "bookworm",
            str(rootfs),
            debian_mirror(),
            timeout=1800,
        )
        (rootfs / "usr/local/bin/python").symlink_to("/usr/bin/python3")  # as the python image
        shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            ["docker", "import", "-", missing[0]],
            stdin=tar.stdout,
            env=engine.env,
            check=True,
            capture_output=True,
            timeout=600,
        )
        tar.wait()
    for name in missing[1:]:
        engine.docker("tag", missing[0], name)
    engine.notes.append(f"built {', '.join(missing)} from a Debian root file system")


def ensure_wheels() -> None:
    """deploy/wheels for the image's Python (`make wheels`)."""
    if not (ROOT / "deploy" / "wheels").is_dir():
        run("make", "-C", str(ROOT), "wheels", timeout=1800)
