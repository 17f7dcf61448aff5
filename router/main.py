"""`pdserve router`: serve the OpenAI API with uvicorn."""

from __future__ import annotations

import uvicorn

from router.app import create_app
from router.config import RouterConfig


def serve(config: RouterConfig) -> None:
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)
