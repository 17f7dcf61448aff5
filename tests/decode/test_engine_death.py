"""A worker whose engine thread dies (killed through the test hook: PDSERVE_TEST_HOOKS=1 and
SIGUSR1) reports unhealthy and exits with code 1 within seconds, instead of hanging every
request behind a green health check; under `pdserve up` it is restarted, and a stream that
was running on it completes on the restarted worker, token for token."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai

from services.launcher import WorkerProcess, free_port
from tests.support.up import Up, stream_completion

PROMPT = "The lighthouse keeper climbed the stairs and"


def test_a_dead_engine_thread_makes_the_worker_unhealthy_and_exit(
    embedded_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("PDSERVE_TEST_HOOKS", "1")
    http_port = free_port()
    worker = WorkerProcess(
        "decode", str(embedded_dir), "memory://", tmp_path, "--num-blocks", "64",
        "--metrics-port", str(http_port), dtype="float32",
    ).start()  # fmt: skip
    try:
        assert httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200
        assert worker.process is not None
        killed = time.monotonic()
        worker.process.send_signal(signal.SIGUSR1)
        code = worker.process.wait(timeout=5)
        print(f"exited {time.monotonic() - killed:.2f}s after the engine thread died")
        assert code == 1
        log = worker.log_path.read_text()
        assert "engine thread died" in log and "engine down: exiting for a restart" in log
    finally:
        worker.stop()


def test_up_restarts_a_worker_whose_engine_died_and_its_stream_completes(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_HOOKS", "1")
    out = Up("--port", str(free_port()), "--kv-store", f"local://{tmp_path}/kv",
             "--num-blocks", "256", "--dtype", "float32")  # fmt: skip
    try:
        url = out.ready()
        pid = int(out.wait_for(r"pdserve: decode-0 started \(pid (\d+)\)", 5).group(1))
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        args = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 60,
                "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
        expected = client.completions.create(**args).choices[0].text

        mark = len(out.lines)
        # mid-stream: the worker's engine thread dies
        text, finishes = stream_completion(client, args, 5, lambda: os.kill(pid, signal.SIGUSR1))
        out.wait_for(r"pdserve: decode-0 exited with code 1; restarting", 5, mark)
        assert text == expected and finishes == ["length"]  # migrated to the restarted worker
        new = int(out.wait_for(r"pdserve: decode-0 started \(pid (\d+)\)", 5, mark).group(1))
        assert new != pid
        again = client.completions.create(**args).choices[0].text
        assert again == expected
        assert not any(re.search(r"router exited", line) for line in out.lines)
    finally:
        out.stop()
