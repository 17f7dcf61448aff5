"""A logging handler that keeps what it is given, for tests that read a logger's messages
(caplog sees only loggers that propagate to the root; pdserve's may not)."""

from __future__ import annotations

import logging


class Records(logging.Handler):
    """The messages logged to the logger it is added to."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
