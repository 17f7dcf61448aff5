"""`pdserve router`: serve the OpenAI API with uvicorn."""

from __future__ import annotations

import uvicorn

from router.app import create_app
from router.config import RouterConfig
from services.settings import Settings, read_secrets


def run(settings: Settings) -> int:
    """The `router` role's entry point (pyproject.toml)."""
    serve(router_config(settings))
    return 0


def serve(config: RouterConfig) -> None:
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)


def router_config(s: Settings) -> RouterConfig:
    """The router's part of the settings, its secret files read."""
    api_keys = s.api_keys
    if s.api_keys_file:
        api_keys += read_secrets(s.api_keys_file, "--api-keys-file")
    admin_key = s.admin_key
    if s.admin_key_file:
        admin_key = read_secrets(s.admin_key_file, "--admin-key-file")[0]
    return RouterConfig(
        host=s.host, port=s.port_for("router"), model=s.model,
        served_model_name=s.served_model_name, prefill=s.prefill, decode=s.decode,
        policy=s.policy, imbalance=s.imbalance, disagg_threshold=s.disagg_threshold,
        api_keys=api_keys, admin_key=admin_key, max_pending=s.max_pending,
        max_prompts=s.max_prompts, max_n=s.max_n, max_body_bytes=s.max_body_bytes,
        health_interval=s.health_interval, health_timeout=s.health_timeout,
        health_failures=s.health_failures, prefill_timeout=s.prefill_timeout,
        retry_wait=s.retry_wait,
        ttft_slo=s.ttft_slo, trace_file=s.trace_file,
    )  # fmt: skip
