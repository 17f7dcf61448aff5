"""The router's settings."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.block_hash import BLOCK_SIZE
from services.settings import DEFAULTS


@dataclass(frozen=True)
class RouterConfig:
    """What the router runs with; defaults and meanings: services/settings.py."""

    host: str = DEFAULTS.host
    port: int = 8000
    model: str = DEFAULTS.model
    served_model_name: str | None = None  # the id clients send; default: the model's name
    prefill: tuple[str, ...] = ()  # worker addresses (host:port) known at start
    decode: tuple[str, ...] = ()
    policy: str = DEFAULTS.policy
    imbalance: int = DEFAULTS.imbalance
    disagg_threshold: int = DEFAULTS.disagg_threshold
    api_keys: tuple[str, ...] = ()  # none: no authentication
    admin_key: str | None = None  # for /admin/workers; none: the admin API is off
    max_pending: int = DEFAULTS.max_pending
    max_prompts: int = DEFAULTS.max_prompts
    max_n: int = DEFAULTS.max_n
    max_body_bytes: int = DEFAULTS.max_body_bytes
    health_interval: float = DEFAULTS.health_interval
    health_timeout: float = DEFAULTS.health_timeout
    health_failures: int = DEFAULTS.health_failures
    prefill_timeout: float = DEFAULTS.prefill_timeout
    retry_wait: float = DEFAULTS.retry_wait
    ttft_slo: float = DEFAULTS.ttft_slo
    breaker_failures: int = 3  # consecutive failures that open a worker's circuit
    breaker_cooldown: float = 5.0  # seconds an open circuit stays open
    block_size: int = BLOCK_SIZE  # must be the workers' (checked at their health checks)
    trace_file: str | None = None  # OpenTelemetry spans appended here (services/tracing.py)
