"""`pdserve router`: serve the OpenAI API with uvicorn."""

from __future__ import annotations

import uvicorn

from router.app import create_app
from services.settings import Settings


def run(settings: Settings) -> int:
    """The `router` role's entry point (pyproject.toml); `settings` checked (secrets read)."""
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.server.host,
        port=settings.port,
        log_level=settings.server.log_level,
        access_log=False,
    )
    return 0
