"""`pdserve up`: the whole stack from one command; a chat through the `openai` client; a
child that dies comes back; SIGINT leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import openai

from services.launcher import PDSERVE, free_port


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie is gone but for its parent
    except FileNotFoundError:
        return False


class Output:
    """The stack's stdout, read on a thread, waited on by pattern."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in self.lines[after:]:
                    if match := re.search(pattern, line):
                        return match
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r}:\n" + "\n".join(self.lines)
                self.changed.wait(left)


def test_up_serves_a_chat_restarts_a_dead_child_and_stops_everything(tmp_path):
    port = free_port()
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "warning"}
    command = [PDSERVE, "up", "--port", str(port), "--kv-store", f"local://{tmp_path}/kv",
               "--num-blocks", "256"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)  # fmt: skip
    out = Output(process)
    try:
        ready = out.wait_for(r"pdserve: ready at (http://\S+/v1)", timeout=300)
        assert ready.group(1) == f"http://127.0.0.1:{port}/v1"
        pids = {
            name: int(pid)
            for line in out.lines
            if (m := re.search(r"pdserve: (\S+) started \(pid (\d+)\)", line))
            for name, pid in [m.groups()]
        }
        assert set(pids) == {"prefill-0", "decode-0", "router"}
        assert any(line.startswith("decode-0 | ") for line in out.lines)  # logs pass through

        client = openai.OpenAI(base_url=ready.group(1), api_key="none", max_retries=0)
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
