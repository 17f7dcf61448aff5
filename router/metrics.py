"""The router's Prometheus metrics (one registry per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.workers.registry import Registry, WorkerState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "From request received to the first token sent",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Between consecutive tokens of a choice (tokens arriving together, as speculative "
            "decoding sends them, share the gap)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "From request received to its last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("pdserve_requests_running", "Requests streaming tokens", registry=r)
        self.waiting = Gauge(
            "pdserve_requests_waiting", "Requests accepted, no token yet", registry=r
        )
        self.waiting_for_worker = Gauge(
            "pdserve_requests_waiting_for_worker",
            "Requests waiting (up to retry_wait) for a worker of a role none is available of",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated for finished requests", registry=r
        )
        self.queried_tokens = Counter(
            "pdserve_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the workers' caches and the KV store",
            registry=r,
        )
        self.cached_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens",
            "Prompt tokens found in the serving worker's own prefix cache",
            registry=r,
        )
        self.store_tokens = Counter(
            "pdserve_kv_store_hit_tokens",
            "Prompt tokens read from the shared KV store instead of computed",
            registry=r,
        )
        self.approximate_tokens = Counter(
            "pdserve_approximate_hit_tokens",
            "Prompt tokens placed from chunks computed for other prompts (approximate KV "
            "reuse), apart from the exact hits above",
            registry=r,
        )
        self.approximate_recomputed = Counter(
            "pdserve_approximate_recomputed_tokens",
            "Of the approximate hits, tokens computed again (--kv-reuse-ratio)",
            registry=r,
        )
        self.hit_ratio = Gauge(
            "pdserve_prefix_cache_hit_ratio",
            "Prompt tokens found in the serving worker's cache / prompt tokens, since start",
            registry=r,
        )
        self.store_hit_ratio = Gauge(
            "pdserve_kv_store_hit_ratio",
            "Prompt tokens read from the KV store / prompt tokens, since start",
            registry=r,
        )
        self.local_prefills = Counter(
            "pdserve_local_prefills",
            "Choices a decode worker prefilled itself: colocated (no prefill workers), "
            "short_prompt (conditional disaggregation), prefill_backlog (past the TTFT SLO on "
            "prefill) or kv_store_down",
            ["reason"],
            registry=r,
        )
        self.shed = Counter(
            "pdserve_requests_shed",
            "Requests refused (429) because their prompts would wait past the TTFT SLO",
            registry=r,
        )
        labels = ["role", "worker"]
        self.worker_healthy = Gauge(
            "pdserve_worker_healthy", "1 if the worker answers", labels, registry=r
        )
        self.worker_running = Gauge(
            "pdserve_worker_running", "Requests running on the worker", labels, registry=r
        )
        self.worker_waiting = Gauge(
            "pdserve_worker_waiting", "Requests queued on the worker", labels, registry=r
        )
        self.worker_free_blocks = Gauge(
            "pdserve_worker_free_blocks", "Free KV blocks", labels, registry=r
        )
        self.worker_unhealthy = Counter(
            "pdserve_worker_unhealthy",
            "Times a worker was marked unhealthy (no answer to health checks, not ready, or "
            "its circuit opened)",
            labels,
            registry=r,
        )
        self.worker_backlog = Gauge(
            "pdserve_worker_backlog_tokens",
            "Prompt tokens sent to the worker to compute, first token not yet back",
            labels,
            registry=r,
        )
        self.worker_prompt_rate = Gauge(
            "pdserve_worker_prompt_tokens_per_second",
            "Prompt tokens the worker computes per second while it has some (0: not measured)",
            labels,
            registry=r,
        )
        self.worker_cached_blocks = Gauge(
            "pdserve_worker_cached_blocks",
            "KV blocks matchable by later prompts",
            labels,
            registry=r,
        )

    def finished(
        self,
        prompt_tokens: int,
        generated: int,
        queried: int,
        cached: int,
        stored: int,
        approximate: tuple[int, int] = (0, 0),
    ) -> None:
        """A request done. `prompt_tokens` counts the prompt once (n choices share it);
        `queried` counts it once per choice, as `cached` (all reused tokens) and `stored`
        (those of them read from the store) do, and `approximate` (tokens placed by
        approximate reuse, of them recomputed)."""
        self.approximate_tokens.inc(approximate[0])
        self.approximate_recomputed.inc(approximate[1])
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.queried_tokens.inc(queried)
        self.cached_tokens.inc(cached - stored)
        self.store_tokens.inc(stored)
        total = self.queried_tokens._value.get()
        if total:
            self.hit_ratio.set(self.cached_tokens._value.get() / total)
            self.store_hit_ratio.set(self.store_tokens._value.get() / total)

    def health_changed(self, worker: WorkerState, healthy: bool) -> None:
        if not healthy:
            self.worker_unhealthy.labels(worker.role, worker.address).inc()

    def render(self, registry: Registry) -> bytes:
        for w in registry.workers.values():
            labels = (w.role, w.address)
            self.worker_healthy.labels(*labels).set(1 if w.available else 0)
            self.worker_running.labels(*labels).set(w.load.running)
            self.worker_waiting.labels(*labels).set(w.load.waiting)
            self.worker_free_blocks.labels(*labels).set(w.load.free_blocks)
            self.worker_cached_blocks.labels(*labels).set(w.load.cached_blocks)
            self.worker_backlog.labels(*labels).set(w.backlog.tokens)
            self.worker_prompt_rate.labels(*labels).set(w.backlog.rate or 0)
        return generate_latest(self.registry)
