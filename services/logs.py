"""Structured logs: one `key=value` line per event on stderr, quiet unless asked.

Call sites pass their fields through `extra`, e.g.
`log.info("converted", extra={"fields": {"file": path, "seconds": 4.2}})`.
`PDSERVE_LOG_LEVEL` (debug, info, warning, error) sets the level; the default, warning, keeps
a healthy process silent.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields |= getattr(record, "fields", {})
        line = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _quote(value: Any) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return f'"{text}"' if (" " in text or "=" in text or not text) else text


def configure(level: str | None = None) -> None:
    """Install the key=value handler on the `pdserve` logger (idempotent)."""
    logger = logging.getLogger("pdserve")
    logger.setLevel((level or os.environ.get("PDSERVE_LOG_LEVEL") or "warning").upper())
    if not any(isinstance(h.formatter, KeyValueFormatter) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(KeyValueFormatter())
        logger.addHandler(handler)
    logger.propagate = False
