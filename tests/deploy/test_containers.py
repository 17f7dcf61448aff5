"""deploy/ in a real container engine (`make test-deploy`; skipped by `make test`): the image
built offline from the wheelhouse, deploy/docker-compose.yml brought up as users do (`docker
compose up --wait`), then with the official client from the host: a chat equal to `pdserve
up`'s as processes, a decode container killed mid-stream under a stream that goes on
unbroken, a crashed worker brought back by the restart policy, and `down -v` leaving nothing.

Where no engine can be installed or started, the module is skipped with one line saying why.
The engine this run started is stopped at the end, and checked gone."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from services.launcher import free_port
from tests.support.cluster import MODEL
from tests.support.containers import (
    ROOT,
    Engine,
    Unavailable,
    ensure_base_images,
    ensure_compose,
    ensure_wheels,
    start_engine,
)
from tests.support.up import Up

pytestmark = pytest.mark.skipif(
    os.environ.get("PDSERVE_DEPLOY_TESTS") != "1", reason="container tests: make test-deploy"
)
PROJECT = "pdserve-test"
COMPOSE = str(ROOT / "deploy" / "docker-compose.yml")
CHAT = [{"role": "user", "content": "Name three rivers in Europe, one line each."}]
STORY = "Tell me a long story about a lighthouse keeper and the sea."


@dataclass
class Stack:
    engine: Engine
    url: str

    def compose(self, *args: str, timeout: float = 1800) -> str:
        return self.engine.docker("compose", "-f", COMPOSE, "-p", PROJECT, *args, timeout=timeout)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)

    def container(self, service: str) -> str:
        return f"{PROJECT}-{service}-1"

    def engine_running(self, service: str) -> float:
        """The worker's own gauge of running sequences, read inside its container."""
        code = (
            "import urllib.request as u; t = u.urlopen('http://127.0.0.1:9100/metrics')"
            ".read().decode(); print([l for l in t.splitlines() if l.startswith("
            "'pdserve_engine_running')][0].split()[-1])"
        )
        return float(self.engine.docker("exec", self.container(service), "python", "-c", code))


def phase(name: str, start: float) -> None:
    print(f"test-deploy: {name} {time.monotonic() - start:.0f}s", flush=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("containers")
    start = time.monotonic()
    try:
        engine = start_engine(work)
    except Unavailable as e:
        print(f"test-deploy: no container engine here: {e}", flush=True)
        pytest.skip(f"no container engine: {e}")
    phase("engine", start)
    try:
        for step in (ensure_compose, ensure_base_images):
            start = time.monotonic()
            step(engine)
            phase(step.__name__, start)
        start = time.monotonic()
        ensure_wheels()
        phase("wheels", start)
        port = free_port()
        engine.env["PDSERVE_PUBLISH"] = f"127.0.0.1:{port}"
        s = Stack(engine, f"http://127.0.0.1:{port}")
        start = time.monotonic()
        s.compose("build")
        phase("build", start)
        size = engine.docker("image", "inspect", "-f", "{{.Size}}", "pdserve:latest")
        print(f"test-deploy: image pdserve:latest {int(size) / 1e9:.2f} GB", flush=True)
        start = time.monotonic()
        s.compose("up", "-d", "--wait", timeout=900)
        phase("up --wait", start)
        yield s
    finally:
        if engine.ok("info"):
            engine.docker("compose", "-f", COMPOSE, "-p", PROJECT, "down", "-v",
                          "--remove-orphans", check=False)  # fmt: skip
        engine.stop()
        if engine.started is not None:
            assert engine.started.poll() is not None, "the dockerd this run started still runs"


def chat_texts(client: openai.OpenAI) -> tuple[str, str]:
    args = dict(model=MODEL, messages=CHAT, max_tokens=32, temperature=0)
    whole = client.chat.completions.create(**args).choices[0].message.content or ""
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices
    )
    return whole, streamed


def test_chat_equals_pdserve_up_as_processes(stack):
    whole, streamed = chat_texts(stack.client())
    assert whole and whole == streamed
    up = Up("--port", str(free_port()))
    try:
        base = up.ready()
        theirs = chat_texts(openai.OpenAI(base_url=base, api_key="x", max_retries=0))
    finally:
        up.stop()
    assert theirs == (whole, streamed)


def test_decode_container_killed_mid_stream(stack):
    client = stack.client()
    args = dict(
        model=MODEL, prompt=STORY, max_tokens=160, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = client.completions.create(**args).choices[0].text
    text, killed, finishes = "", None, []
    for i, chunk in enumerate(client.completions.create(**args, stream=True)):
        for c in chunk.choices:
            text += c.text
            finishes += [c.finish_reason] if c.finish_reason else []
        if i == 10:
            serving = [s for s in ("decode-1", "decode-2") if stack.engine_running(s) >= 1]
            assert len(serving) == 1, "the stream runs on exactly one decode worker"
            killed = serving[0]
            stack.engine.docker("kill", stack.container(killed))
    assert killed is not None and finishes == ["length"]
    assert text == expected  # no gap, no duplicate
    # Docker does not restart a container stopped by `docker kill` (a manual stop): started
    # again by hand here; the restart policy is checked on a crash below
    stack.engine.docker("start", stack.container(killed))
    wait_healthy(stack, killed)


def test_a_crashed_worker_comes_back_by_the_restart_policy(stack):
    """The worker process killed inside its container (a crash, an OOM kill): the container
    exits, the policy restarts it, it turns healthy and serves."""
    name = stack.container("decode-2")
    before = int(stack.engine.docker("inspect", "-f", "{{.RestartCount}}", name))
    kill = (
        "import os, signal\nfor p in os.listdir('/proc'):\n if p.isdigit() and int(p) > 1"
        " and int(p) != os.getpid() and open(f'/proc/{p}/comm').read().strip() == 'pdserve':"
        "\n  os.kill(int(p), signal.SIGKILL)"
    )
    stack.engine.docker("exec", name, "python", "-c", kill, check=False)
    deadline = time.monotonic() + 60
    while int(stack.engine.docker("inspect", "-f", "{{.RestartCount}}", name)) == before:
        assert time.monotonic() < deadline, "the container was not restarted"
        time.sleep(1)
    wait_healthy(stack, "decode-2")
    for _ in range(4):  # both decode workers serve again
        r = stack.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop")


def wait_healthy(stack: Stack, service: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    name = stack.container(service)
    while stack.engine.docker("inspect", "-f", "{{.State.Health.Status}}", name).strip() != (
        "healthy"
    ):
        assert time.monotonic() < deadline, f"{service} not healthy in {timeout}s"
        time.sleep(2)
    deadline = time.monotonic() + 60
    while httpx.get(f"{stack.url}/metrics").text.count(f'worker="{service}:') == 0 or any(
        line.endswith(" 0.0")
        for line in httpx.get(f"{stack.url}/metrics").text.splitlines()
        if line.startswith("pdserve_worker_healthy") and f"{service}:" in line
    ):
        assert time.monotonic() < deadline, f"the router does not see {service} healthy"
        time.sleep(1)


def test_down_leaves_nothing(stack):
    stack.compose("down", "-v", "--remove-orphans")
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in ("container", "network", "volume"):
        left = stack.engine.docker(
            kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", label
        )
        assert left.strip() == "", f"{kind}s left behind: {left}"


def test_compose_files_are_valid(stack):
    """The GPU override merges with the main file (`docker compose config`)."""
    gpu = str(Path(COMPOSE).with_name("docker-compose.gpu.yml"))
    out = stack.engine.docker("compose", "-f", COMPOSE, "-f", gpu, "config")
    assert "decode-1" in out and "driver: nvidia" in out
