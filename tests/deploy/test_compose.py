"""deploy/docker-compose.yml, run without Docker: every service `docker compose up` starts is
started here as a local process with the command, environment and health check the file
gives (service names mapped to 127.0.0.1, each listening port moved to a free one), in
`depends_on` order, and a streamed chat goes through the router. So the file's commands and
settings are known to work where no Docker engine runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.launcher import PDSERVE, free_port
from tests.support.cluster import greedy_chat_in_process

COMPOSE = Path(__file__).parents[2] / "deploy" / "docker-compose.yml"
PORT_SETTINGS = ("PDSERVE_PORT", "PDSERVE_METRICS_PORT")
# what the shell gives compose for ${...} (smaller KV pools: the test machine runs it all)
SHELL = {"PDSERVE_KV_CACHE_GB": "0.25"}


def interpolate(text: str, shell: dict[str, str] = SHELL) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}, from `shell`."""

    def value(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if name in shell and (shell[name] or op != ":-"):
            return shell[name]
        return default if op else ""

    return re.sub(r"\$\{(\w+)(:?-)?([^}]*)\}", value, text)


def listening_ports(spec: dict) -> list[int]:
    env = spec.get("environment", {})
    ports = [int(env[k]) for k in PORT_SETTINGS if k in env]
    command = spec.get("command", [])
    if command and command[0] == "redis-server":
        ports.append(int(command[command.index("--port") + 1]))
    return ports


class LocalCompose:
    def __init__(self, workdir: Path) -> None:
        spec = yaml.safe_load(interpolate(COMPOSE.read_text()))
        # what a plain `docker compose up` starts: services outside opt-in profiles
        self.services = {n: s for n, s in spec["services"].items() if not s.get("profiles")}
        self.ports = {
            (name, port): free_port()
            for name, s in self.services.items()
            for port in listening_ports(s)
        }
        self.workdir = workdir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def local(self, value: str) -> str:
        """A value with every `service:port` pointed at where that service listens here."""
        for (name, port), here in self.ports.items():
            value = re.sub(rf"\b{re.escape(name)}:{port}\b", f"127.0.0.1:{here}", value)
        return value

    def environment(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        for key, value in self.services[name].get("environment", {}).items():
            if value is None:  # compose: taken from the shell, where it is not set
                continue
            value = str(value)
            if key in PORT_SETTINGS:
                value = str(self.ports[(name, int(value))])
            elif key == "PDSERVE_HOST":
                value = "127.0.0.1"
            env[key] = self.local(value)
        return env

    def argv(self, name: str, command: list[str]) -> list[str]:
        out = []
        for i, arg in enumerate(command):
            if i > 0 and command[i - 1] in ("--port", "-p"):
                arg = str(self.ports.get((name, int(arg)), arg))
            out.append(self.local(str(arg)))
        binary = {"pdserve": PDSERVE}.get(out[0]) or shutil.which(out[0])
        assert binary, f"{out[0]} is not installed"
        return [binary, *out[1:]]

    def order(self) -> list[str]:
        done: list[str] = []
        while len(done) < len(self.services):
            for name, spec in self.services.items():
                if name not in done and all(d in done for d in spec.get("depends_on", {})):
                    done.append(name)
        return done

    def healthy(self, name: str) -> bool:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        result = subprocess.run(
            self.argv(name, test[1:]), env=self.environment(name), capture_output=True, timeout=30
        )
        return result.returncode == 0

    def up(self, timeout: float = 300) -> None:
        for name in self.order():
            spec = self.services[name]
            for dependency, condition in spec.get("depends_on", {}).items():
                assert condition == {"condition": "service_healthy"}
                self.wait_healthy(dependency, timeout)
            log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (the child keeps it)
            self.processes[name] = subprocess.Popen(
                self.argv(name, spec["command"]),
                env=self.environment(name),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        for name in self.services:
            self.wait_healthy(name, timeout)

    def wait_healthy(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy(name):
            process = self.processes[name]
            log = (self.workdir / f"{name}.log").read_text()
            assert process.poll() is None, f"{name} exited: {log[-3000:]}"
            assert time.monotonic() < deadline, f"{name} not healthy: {log[-3000:]}"
            time.sleep(1)

    def down(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def scraped_by_prometheus_and_the_autoscalers(stack: LocalCompose) -> None:
    """Prometheus' targets are services and ports of the compose file; each worker's side door
    serves the metric the Kubernetes autoscalers scale on."""
    config = yaml.safe_load((COMPOSE.parent / "prometheus" / "prometheus.yml").read_text())
    targets = [
        t
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for t in group["targets"]
    ]
    assert {(t.split(":")[0], int(t.split(":")[1])) for t in targets} == set(stack.ports) - {
        ("redis", 6379),
        *((n, p) for n, p in stack.ports if p in (50051, 50052)),
    }
    hpa = yaml.safe_load_all((COMPOSE.parent / "k8s" / "hpa.yaml").read_text())
    wanted = {m["pods"]["metric"]["name"] for h in hpa for m in h["spec"]["metrics"]}
    for name in ("prefill-1", "decode-1"):
        port = stack.ports[(name, 9100)]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        assert wanted <= exposed and "pdserve_kv_store_block_hits_total" in exposed
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


def test_compose_services_serve_a_streamed_chat_as_local_processes(tmp_path):
    stack = LocalCompose(tmp_path)
    assert set(stack.services) == {
        "redis",
        "router",
        "prefill-1",
        "prefill-2",
        "decode-1",
        "decode-2",
    }
    redis_args = stack.services["redis"]["command"]
    assert redis_args[redis_args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert redis_args[redis_args.index("--save") + 1] == ""
    published = stack.services["router"]["ports"][0]
    assert published == "8000:8000"
    try:
        stack.up()
        port = stack.ports[("router", 8000)]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
            stream=True,
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == greedy_chat_in_process("What is the capital of France?", 20)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        # the router found all four workers under their compose names
        for name in ("prefill-1", "prefill-2", "decode-1", "decode-2"):
            assert stack.processes[name].poll() is None
        health = {
            line for line in (tmp_path / "router.log").read_text().splitlines() if "healthy" in line
        }
        assert len(health) == 4
        scraped_by_prometheus_and_the_autoscalers(stack)
    finally:
        stack.down()


def test_the_gpu_file_gives_each_worker_a_device_of_its_own():
    """docker-compose.gpu.yml over the base file: every worker reserves one NVIDIA device by
    id, no two the same, runs on CUDA and sizes its pool from the device's memory; its
    settings parse (a worker's settings loaded from that environment)."""
    from services import settings

    base = yaml.safe_load(interpolate(COMPOSE.read_text(), {}))["services"]
    gpu_file = (COMPOSE.parent / "docker-compose.gpu.yml").read_text()
    gpu = yaml.safe_load(interpolate(gpu_file, {}))
    workers = [
        n
        for n, s in base.items()
        if s.get("command", [None])[0:2] in (["pdserve", "prefill"], ["pdserve", "decode"])
    ]
    assert sorted(workers) == ["decode-1", "decode-2", "prefill-1", "prefill-2"]
    ids = []
    for name in workers:
        (device,) = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "count" not in device  # count: 1 gives every worker GPU 0
        ids += device["device_ids"]
        env = {**base[name]["environment"], **gpu["services"][name]["environment"]}
        assert env["PDSERVE_DEVICE"] == "cuda"
        role = base[name]["command"][1]
        environ = {k: str(v) for k, v in env.items()}
        engine = settings.load(role, None, environ).settings.engine
        assert engine.kv_cache_gb is None and engine.gpu_memory_utilization == 0.9
    assert ids == ["0", "1", "2", "3"]


def test_the_grid_file_makes_each_worker_a_data_parallel_group_the_router_sees():
    """docker-compose.grid.yml over the base file: each worker service one data-parallel group
    with a device per rank (none shared), whose settings parse; the router lists every
    rank's port of every service."""
    from services import settings

    base = yaml.safe_load(interpolate(COMPOSE.read_text(), {}))["services"]
    grid = yaml.safe_load(interpolate((COMPOSE.parent / "docker-compose.grid.yml").read_text(), {}))
    ids, targets = [], {"prefill": [], "decode": []}
    for name in ("prefill-1", "prefill-2", "decode-1", "decode-2"):
        (device,) = grid["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        env = {k: str(v) for k, v in {**base[name]["environment"],
                                      **grid["services"][name]["environment"]}.items()}  # fmt: skip
        role = base[name]["command"][1]
        loaded = settings.load(role, None, env).settings
        ranks = loaded.worker.data_parallel * loaded.model.tensor_parallel
        assert loaded.model.device == "cuda" and len(device["device_ids"]) == ranks == 2
        ids += device["device_ids"]
        targets[role] += [f"{name}:{loaded.port + r}" for r in range(loaded.worker.data_parallel)]
    assert sorted(ids) == [str(i) for i in range(8)]
    router = grid["services"]["router"]["environment"]
    assert router["PDSERVE_PREFILL"].split(",") == targets["prefill"]
    assert router["PDSERVE_DECODE"].split(",") == targets["decode"]
