"""`pdserve up` as a subprocess for tests: its output read on a thread and waited on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from services.launcher import PDSERVE


class Up:
    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PDSERVE_LOG_LEVEL": "warning"}
        self.process = subprocess.Popen(
            [PDSERVE, "up", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match[str]:
        """The first line (from line `after` on) matching `pattern`."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in self.lines[after:]:
                    if match := re.search(pattern, line):
                        return match
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r}:\n" + "\n".join(self.lines)
                self.changed.wait(left)

    def ready(self, timeout: float = 300) -> str:
        """The API's base URL, once `pdserve up` says it is ready."""
        return self.wait_for(r"pdserve: ready at (http://\S+/v1)", timeout).group(1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                return self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def stream_completion(
    client: Any, args: dict[str, Any], at: int, act: Callable[[], None]
) -> tuple[str, list[str]]:
    """A streamed completion's text and finish reasons; `act()` runs once, after chunk `at`
    (a fault injected mid-stream)."""
    text, finishes = "", []
    for i, chunk in enumerate(client.completions.create(**args, stream=True, timeout=120)):
        for choice in chunk.choices:
            text += choice.text
            finishes += [choice.finish_reason] if choice.finish_reason else []
        if i == at:
            act()
    return text, finishes
