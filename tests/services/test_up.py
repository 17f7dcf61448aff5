"""`pdserve up`: the whole stack from one command; a chat through the `openai` client; a
child that dies comes back; SIGINT leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import time

import openai

from services.launcher import free_port
from tests.support.up import Up


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie is gone but for its parent
    except FileNotFoundError:
        return False


def test_up_serves_a_chat_restarts_a_dead_child_and_stops_everything(tmp_path):
    port = free_port()
    out = Up("--port", str(port), "--kv-store", f"local://{tmp_path}/kv", "--num-blocks", "256")
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
        answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                max_tokens=20, temperature=0)  # fmt: skip
        assert "Paris" in answer.choices[0].message.content

        mark = len(out.lines)
        os.kill(pids["decode-0"], signal.SIGKILL)
        out.wait_for(r"pdserve: decode-0 exited with code -9; restarting in 1s", 10, mark)
        new = int(out.wait_for(r"pdserve: decode-0 started \(pid (\d+)\)", 10, mark).group(1))
        pids["decode-0 (restarted)"] = new
        out.wait_for(r"decode-0 \| .*msg=serving", 120, mark)
        deadline = time.monotonic() + 30
        while True:  # served again once the router has seen it healthy
            try:
                again = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20, temperature=0
                )
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert again.choices[0].message.content == answer.choices[0].message.content

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    survivors = [name for name, pid in pids.items() if alive(pid) and name != "decode-0"]
    assert survivors == []


def test_children_get_the_resolved_settings_and_other_variables(monkeypatch, tmp_path):
    from services.settings import Settings
    from services.up import Stack

    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/somewhere/cache")  # not a setting: passed on
    monkeypatch.setenv("PDSERVE_NUM_BLOCKS", "5")  # a setting: as resolved, not as raw
    stack = Stack(Settings(num_blocks=77, num_decode=2, port=9999, policy="least_load"))
    store = stack.build(tmp_path)
    assert store == "local://"
    children = {c.name: c for c in stack.children}
    assert set(children) == {"prefill-0", "decode-0", "decode-1", "router"}
    for child in children.values():
        assert child.env["PDSERVE_CACHE_DIR"] == "/somewhere/cache"
    decode = children["decode-1"].env
    assert decode["PDSERVE_NUM_BLOCKS"] == "77" and decode["PDSERVE_KV_STORE"] == "local://"
    assert "PDSERVE_POLICY" not in decode
    router = children["router"]
    assert router.env["PDSERVE_POLICY"] == "least_load" and "PDSERVE_NUM_BLOCKS" not in router.env
    argv = router.argv
    assert argv[argv.index("--port") + 1] == "9999"
    workers = argv[argv.index("--decode") + 1].split(",")
    assert workers == [f"127.0.0.1:{children[f'decode-{i}'].argv[-1]}" for i in (0, 1)]
