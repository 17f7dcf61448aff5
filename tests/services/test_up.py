"""`pdserve up`: the whole stack from one command; a chat through the `openai` client; a
child that dies comes back; SIGINT leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
from urllib.parse import urlsplit

import openai
import pytest
import redis as redis_py

from kvstore import local
from kvstore.keyfile import read_key
from services.launcher import PDSERVE, free_port, wait_for_port
from tests.support.cluster import greedy_chat_in_process, wait_until
from tests.support.redis_servers import require_binaries
from tests.support.up import Up


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie is gone but for its parent
    except FileNotFoundError:
        return False


def test_up_serves_a_chat_restarts_a_dead_child_and_stops_everything(tmp_path):
    port = free_port()
    out = Up(
        "--port",
        str(port),
        "--kv-store",
        f"local://{tmp_path}/kv",
        "--num-blocks",
        "256",
        "--no-colocated",
    )
    process = out.process
    try:
        url = out.ready()
        assert url == f"http://127.0.0.1:{port}/v1"
        pids = {
            name: int(pid)
            for line in out.lines
            if (m := re.search(r"pdserve: (\S+) started \(pid (\d+)\)", line))
            for name, pid in [m.groups()]
        }
        assert set(pids) == {"prefill-0", "decode-0", "router"}
        assert any(line.startswith("decode-0 | ") for line in out.lines)  # logs pass through

        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20, temperature=0
        )
        assert answer.choices[0].message.content == greedy_chat_in_process(
            messages[0]["content"], 20
        )
        # the README's first example, in the dtype auto picks here
        assert answer.choices[0].message.content == "The capital of France is Paris."

        mark = len(out.lines)
        os.kill(pids["prefill-0"], signal.SIGKILL)  # every worker at once
        os.kill(pids["decode-0"], signal.SIGKILL)
        out.wait_for(r"pdserve: decode-0 exited with code -9; restarting in 1s", 10, mark)
        # asked while no worker is up: the request waits (retry_wait) for them to come back
        again = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20, temperature=0
        )
        assert again.choices[0].message.content == answer.choices[0].message.content
        for name in ("prefill-0", "decode-0"):
            found = out.wait_for(rf"pdserve: {name} started \(pid (\d+)\)", 10, mark)
            pids[f"{name} (restarted)"] = int(found.group(1))

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    survivors = [name for name, pid in pids.items() if alive(pid) and name != "decode-0"]
    assert survivors == []


def test_children_get_the_resolved_settings_and_other_variables(monkeypatch, tmp_path):
    from services.settings import build as settings_of
    from services.up import Stack

    monkeypatch.setattr(local, "RAM_DIR", tmp_path)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/somewhere/cache")  # not a setting: passed on
    monkeypatch.setenv("PDSERVE_NUM_BLOCKS", "5")  # a setting: as resolved, not as raw
    stack = Stack(
        settings_of(num_blocks=77, num_decode=2, port=9999, policy="least_load", colocated=False)
    )
    store = stack.build(tmp_path / "work")
    private = tmp_path / f"pdserve-{os.getuid()}" / "up-127.0.0.1-9999"
    assert store == f"local://{private}"
    children = {c.name: c for c in stack.children}
    assert set(children) == {"prefill-0", "decode-0", "decode-1", "router"}
    for child in children.values():
        assert child.env["PDSERVE_CACHE_DIR"] == "/somewhere/cache"
    decode = children["decode-1"].env
    assert decode["PDSERVE_NUM_BLOCKS"] == "77" and decode["PDSERVE_KV_STORE"] == store
    assert decode["PDSERVE_KV_KEY_FILE"] == str(private / "kv.key")
    assert "PDSERVE_POLICY" not in decode
    router = children["router"]
    assert router.env["PDSERVE_POLICY"] == "least_load" and "PDSERVE_NUM_BLOCKS" not in router.env
    assert "PDSERVE_KV_STORE" not in router.env and "PDSERVE_KV_KEY_FILE" not in router.env
    argv = router.argv
    assert argv[argv.index("--port") + 1] == "9999"
    workers = argv[argv.index("--decode") + 1].split(",")
    assert workers == [f"127.0.0.1:{children[f'decode-{i}'].argv[-1]}" for i in (0, 1)]
    # workers share the host's cores: OpenMP threads spin briefly (services/up.py)
    assert decode["GOMP_SPINCOUNT"] == children["prefill-0"].env["GOMP_SPINCOUNT"] == "1000"
    assert "GOMP_SPINCOUNT" not in router.env


def test_a_users_openmp_setting_reaches_the_workers_unchanged(monkeypatch, tmp_path):
    from services.settings import build as settings_of
    from services.up import Stack

    monkeypatch.setattr(local, "RAM_DIR", tmp_path)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    stack = Stack(settings_of(port=9998))
    stack.build(tmp_path / "work")
    decode = next(c for c in stack.children if c.name == "decode-0").env
    assert decode["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in decode


def test_each_stack_has_a_private_store_and_key_that_a_restart_keeps(monkeypatch, tmp_path):
    from services.settings import build as settings_of
    from services.up import Stack

    monkeypatch.setattr(local, "RAM_DIR", tmp_path)
    mine = tmp_path / f"pdserve-{os.getuid()}"

    def build(port: int) -> tuple[str, str]:
        stack = Stack(settings_of(port=port))
        store = stack.build(tmp_path / f"work-{port}")
        return store, stack.children[0].env["PDSERVE_KV_KEY_FILE"]

    first_store, first_key = build(8100)
    assert first_store == f"local://{mine}/up-127.0.0.1-8100"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert stat.S_IMODE((mine / "up-127.0.0.1-8100").stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(first_key).st_mode) == 0o600
    key = read_key(first_key)
    assert len(key) == 64
    other_store, other_key = build(8101)  # another stack on the host: its own store and key
    assert other_store == f"local://{mine}/up-127.0.0.1-8101" and read_key(other_key) != key
    assert build(8100) == (first_store, first_key)  # the same stack again: its cache stays
    assert read_key(first_key) == key

    given = tmp_path / "given.key"
    given.write_text("g" * 32)
    stack = Stack(settings_of(port=8100, kv_key_file=str(given), kv_store=f"local://{tmp_path}/kv"))
    assert stack.build(tmp_path / "work") == f"local://{tmp_path}/kv"
    assert stack.children[0].env["PDSERVE_KV_KEY_FILE"] == str(given)
    assert not (tmp_path / "kv" / "kv.key").exists()


def test_redis_child_has_a_password_and_a_memory_cap_from_a_private_config(tmp_path):
    from services.settings import build as settings_of
    from services.up import Stack

    require_binaries()
    stack = Stack(
        settings_of(redis=True, redis_max_memory="64mb", kv_key_file="/k", colocated=False)
    )
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    store = stack.build(work)
    password = urlsplit(store).password
    assert password and len(password) >= 32 and store.startswith("redis://:")
    children = {c.name: c for c in stack.children}
    redis = children["redis"]
    conf = work / "redis.conf"
    assert redis.argv == ["redis-server", str(conf)]
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    lines = conf.read_text().splitlines()
    assert f'requirepass "{password}"' in lines
    assert "maxmemory 64mb" in lines and "maxmemory-policy allkeys-lru" in lines
    for child in children.values():  # the password is on no command line
        assert not any(password in arg for arg in child.argv), child.name
    for name in ("prefill-0", "decode-0"):
        assert children[name].env["PDSERVE_KV_STORE"] == store
    assert "PDSERVE_KV_STORE" not in children["router"].env

    process = subprocess.Popen(redis.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = urlsplit(store).port
        assert port is not None
        wait_for_port(port)
        with open(f"/proc/{process.pid}/cmdline", "rb") as f:
            assert password.encode() not in f.read()
        anonymous = redis_py.Redis(port=port)
        with pytest.raises(redis_py.AuthenticationError):
            anonymous.ping()
        client = redis_py.Redis.from_url(store)
        assert client.config_get("maxmemory") == {"maxmemory": str(64 << 20)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("save") == {"save": ""}
        client.close()
        anonymous.close()
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("cap", ["lots", "2 gb", "-1"])
def test_a_bad_redis_memory_cap_is_refused(tmp_path, cap):
    from services.settings import SettingsError, check
    from services.settings import build as settings_of

    require_binaries()
    with pytest.raises(SettingsError, match=r"redis_max_memory: .* is not a size like 512mb"):
        check(settings_of(redis=True, redis_max_memory=cap))


def test_colocated_stack_has_no_prefill_worker_and_serves_the_same_answer(tmp_path):
    from services.settings import build as settings_of
    from services.up import Stack

    stack = Stack(settings_of(colocated=True, port=9997, kv_store=f"local://{tmp_path}/kv"))
    stack.build(tmp_path / "work")
    children = {c.name: c for c in stack.children}
    assert set(children) == {"decode-0", "router"}
    assert "GOMP_SPINCOUNT" not in children["decode-0"].env  # alone on the cores
    assert int(children["router"].env["PDSERVE_DISAGG_THRESHOLD"]) > 8192
    assert stack.topology() == "colocated: decode x1 computing prompts too"

    answers = {}
    for mode in ("--colocated", "--no-colocated"):  # both said: the host's cores decide neither
        out = Up(
            "--port",
            str(free_port()),
            "--kv-store",
            f"local://{tmp_path}/kv{mode}",
            "--num-blocks",
            "256",
            mode,
        )
        try:
            url = out.ready()
            ready = out.wait_for(r"pdserve: ready at .*", 5).group(0)
            assert ("colocated: decode x1" in ready) == (mode == "--colocated")
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
            answers[mode] = (
                client.completions.create(
                    model="SmolLM2-135M-Instruct",
                    prompt="The capital of France is",
                    max_tokens=12,
                    temperature=0,
                )
                .choices[0]
                .text
            )
        finally:
            assert out.stop() == 0
    assert answers["--colocated"] == answers["--no-colocated"]


def test_unset_colocation_is_chosen_by_the_cores_and_said():
    from services.settings import build as settings_of
    from services.up import Stack

    small = Stack(settings_of(port=9996), cores=2)
    assert small.colocated
    assert small.topology() == (
        "colocated: decode x1 computing prompts too (chosen for 2 cores: faster than prefill "
        "and decode processes sharing them; --no-colocated to run prefill workers)"
    )
    assert not Stack(settings_of(port=9996), cores=16).colocated
    assert Stack(settings_of(port=9996), cores=16).topology() == "prefill x1, decode x1"
    asked = Stack(settings_of(port=9996, num_prefill=2), cores=2)  # prefill workers by number
    assert not asked.colocated and asked.topology() == "prefill x2, decode x1"
    assert not Stack(settings_of(port=9996, colocated=False), cores=2).colocated
    assert Stack(settings_of(port=9996, colocated=True), cores=64).colocated


def test_settings_a_role_would_refuse_stop_up_before_any_child_starts(tmp_path):
    """Every role's settings are checked in up's own process: the model's architecture, a
    store directory anyone may write to. Exit code 2 with the error, nothing started."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for args, error in (
        (("--model", str(model)), "unsupported architecture ['GPT2LMHeadModel']"),
        (("--kv-store", f"local://{shared}"), "is writable by every user"),
    ):
        done = subprocess.run(
            [PDSERVE, "up", "--port", str(free_port()), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert error in done.stderr and "pdserve: error:" in done.stderr
        assert "started (pid" not in done.stdout


def test_a_child_refusing_its_settings_before_ready_stops_up_and_later_is_restarted():
    from services.settings import SettingsError
    from services.settings import build as settings_of
    from services.up import Child, Stack

    stack = Stack(settings_of(port=9995))
    refusing = ["sh", "-c", "echo 'pdserve: error: num_blocks: must be at least 1'; exit 2"]
    stack.children = [Child("decode-0", refusing, dict(os.environ))]
    stack.children[0].start()
    stack.children[0].process.wait()
    with pytest.raises(
        SettingsError,
        match="decode-0 refused its settings: pdserve: error: num_blocks: must be at least 1",
    ):
        stack.supervise_once()
    child = stack.children[0]
    child.ever_ready = True  # it once served: a later exit, whatever its code, is restarted
    stack.supervise_once()
    assert child.restart_at is not None


def test_a_colocated_up_with_a_redis_store_leaves_the_prompts_blocks_there(tmp_path):
    """`pdserve up --kv-store redis://...` colocated (what `up` picks below 8 cores): a
    300-token prompt's and its answer's full blocks are in Redis afterwards, every one."""
    from tests.support.redis_servers import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    out = Up(
        "--port", str(free_port()), "--kv-store", server.url, "--colocated", "--num-blocks", "128"
    )
    try:
        client = openai.OpenAI(base_url=out.ready(), api_key="none", max_retries=0)
        prompt = [100 + (7 * i) % 4000 for i in range(300)]
        client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        store = redis_py.Redis.from_url(server.url)
        full = (300 + 8) // 16  # the generation's full blocks, written back at its end
        wait_until(lambda: store.dbsize() >= full, timeout=10)
        keys = [k.decode() for k in store.keys("*")]
        assert len(keys) == full and all(k.startswith("pdserve:kv:") for k in keys)
    finally:
        out.stop()
        server.stop()
