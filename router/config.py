"""The router's settings."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.block_hash import BLOCK_SIZE


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "embedded"  # tokenizer and chat template come from here (no weights loaded)
    served_model_name: str | None = None  # the id clients send; default: the model's name
    prefill: tuple[str, ...] = ()  # worker addresses (host:port) known at start
    decode: tuple[str, ...] = ()
    policy: str = "kv_aware"  # round_robin, least_load, kv_aware
    imbalance: int = 8  # kv_aware: cache loses to load past this many requests' difference
    disagg_threshold: int = 0  # prompts with fewer uncached tokens go straight to decode (0: off)
    api_keys: tuple[str, ...] = ()  # none: no authentication
    admin_key: str | None = None  # for /admin/workers; none: the admin API is off
    max_pending: int = 256  # sequences (prompts x n) in flight before 429
    max_prompts: int = 64  # prompts in one completions request
    max_n: int = 16  # choices per prompt
    max_body_bytes: int = 4 << 20
    health_interval: float = 1.0  # seconds between health checks
    health_timeout: float = 5.0  # seconds a health check may take
    health_failures: int = 3  # failed checks in a row that make a worker unhealthy
    prefill_timeout: float = 120.0  # seconds a Prefill may take before another worker is tried
    retry_wait: float = 30.0  # seconds to wait for a worker to come back when all failed
    ttft_slo: float = 0.0  # seconds a prompt may be expected to wait (429 past it); 0: no limit
    breaker_failures: int = 3  # consecutive failures that open a worker's circuit
    breaker_cooldown: float = 5.0  # seconds an open circuit stays open
    block_size: int = BLOCK_SIZE  # must be the workers' (checked at their health checks)
    trace_file: str | None = None  # OpenTelemetry spans appended here (services/tracing.py)
