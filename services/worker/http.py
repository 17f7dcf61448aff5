"""A worker's HTTP side door (with `--metrics-port`): Prometheus `/metrics` for scrapers and
autoscalers, `/health` (200 when serving, 503 otherwise) for probes that speak HTTP, and for
MoE models `/experts` (tokens per expert; with the experts over processes, `--expert-parallel`
or `--data-parallel`, the placement and the ranks' balance, `parallel`, and this rank's votes,
empty passes and exchanges, `data_parallel`) and `POST /experts/rebalance` (plan a new
placement at the next pass, on every rank).

It runs on a thread of its own and reads what the gRPC side already keeps: the engine's
load snapshot, the store's counters and the worker's own. It sees the worker as `WorkerView`,
not as the server's `Worker` class: the server starts this side door, so importing it back would
make a cycle.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvstore.store import StoreStats
    from services.engine.driver import EngineLoad
    from services.engine.speculative import SpecStats

GAUGES = {  # EngineLoad field -> (metric, help)
    "waiting": ("pdserve_engine_waiting", "Requests queued, not yet running (queue depth)"),
    "running": ("pdserve_engine_running", "Requests in the running batch"),
    "free_blocks": ("pdserve_engine_free_blocks", "KV blocks free (cached ones included)"),
    "cached_blocks": ("pdserve_engine_cached_blocks", "KV blocks matchable by later prompts"),
    "total_blocks": ("pdserve_engine_total_blocks", "KV blocks in the pool"),
    "referenced_blocks": ("pdserve_engine_referenced_blocks", "KV blocks held by requests"),
    "tokens_in_flight": ("pdserve_engine_tokens_in_flight", "Tokens of running requests"),
}


class _Driver(Protocol):
    @property
    def load(self) -> EngineLoad: ...


class _Store(Protocol):
    def stats(self) -> StoreStats: ...


class _Counters(Protocol):
    @property
    def recomputed_tokens(self) -> int: ...


class _Speculator(Protocol):
    @property
    def stats(self) -> SpecStats: ...


class _Model(Protocol):
    def expert_counts(self) -> dict[int, list[int]]: ...


class _Lockstep(Protocol):
    def spread(self) -> dict[str, Any]: ...

    def snapshot(self) -> dict[str, Any]: ...

    def request_rebalance(self) -> None: ...


class _Engine(Protocol):
    @property
    def speculator(self) -> _Speculator | None: ...

    @property
    def model(self) -> _Model: ...


class WorkerView(Protocol):
    """What the side door reads of a worker (services.worker.server.Worker is one). Contract:
    it reads on its own thread while the worker runs, and writes nothing; each value is a
    snapshot or a counter, and may be one engine step behind."""

    @property
    def role(self) -> str: ...

    @property
    def ready(self) -> bool: ...  # serving, with an engine that is alive

    @property
    def driver(self) -> _Driver: ...

    @property
    def store(self) -> _Store: ...

    @property
    def counters(self) -> _Counters: ...

    @property
    def engine(self) -> _Engine: ...

    @property
    def lockstep(self) -> _Lockstep | None: ...  # --expert-parallel or a MoE's --data-parallel


class WorkerCollector:
    def __init__(self, worker: WorkerView) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self.worker
        role = [w.role]
        ready = GaugeMetricFamily("pdserve_engine_ready", "1 while serving", labels=["role"])
        ready.add_metric(role, 1.0 if w.ready else 0.0)
        yield ready
        load = w.driver.load
        for name, (metric, text) in GAUGES.items():
            gauge = GaugeMetricFamily(metric, text, labels=["role"])
            gauge.add_metric(role, float(getattr(load, name)))
            yield gauge
        stats = w.store.stats()
        hits = stats.hits - stats.corrupt
        counters = {
            "pdserve_kv_store_block_hits": ("Blocks read from the store", hits),
            "pdserve_kv_store_block_misses": ("Blocks asked for and not usable", stats.misses),
            "pdserve_kv_store_block_writes": ("Blocks written to the store", stats.puts),
            "pdserve_kv_store_corrupt": ("Values refused by the codec", stats.corrupt),
            "pdserve_kv_store_unavailable": ("Store calls that failed", stats.unavailable),
            "pdserve_recomputed_tokens": (
                "Prompt tokens computed because the store missed",
                w.counters.recomputed_tokens,
            ),
        }
        spec = w.engine.speculator
        if spec is not None:  # mean accepted per verification = accepted / steps
            counters |= {
                "pdserve_spec_proposed_tokens": (
                    "Tokens proposed for verification",
                    spec.stats.proposed,
                ),
                "pdserve_spec_accepted_tokens": ("Proposed tokens accepted", spec.stats.accepted),
                "pdserve_spec_verify_steps": (
                    "Sequence-steps that verified proposed tokens",
                    spec.stats.steps,
                ),
            }
        for metric, (text, value) in counters.items():
            counter = CounterMetricFamily(metric, text, labels=["role"])
            counter.add_metric(role, float(value))
            yield counter
        experts = w.engine.model.expert_counts()
        if experts:  # MoE models: the load each expert takes, what a balancer works from
            routed = CounterMetricFamily(
                "pdserve_moe_expert_tokens",
                "Tokens routed to each expert, by MoE layer",
                labels=["role", "layer", "expert"],
            )
            for layer, counts in experts.items():
                for expert, count in enumerate(counts):
                    routed.add_metric([w.role, str(layer), str(expert)], float(count))
            yield routed
        if w.lockstep is not None:
            yield from _balance_metrics(w.role, w.lockstep.spread())


def _balance_metrics(role: str, group: dict[str, Any]) -> Iterator[Metric]:
    """Expert parallelism's balance: rows per rank, the imbalance, the rebalances."""
    rows = CounterMetricFamily(
        "pdserve_moe_rank_tokens",
        "Routed rows each expert rank computed, by MoE layer",
        labels=["role", "layer", "rank"],
    )
    for layer, per_rank in group["rank_tokens"].items():
        for rank, count in enumerate(per_rank):
            rows.add_metric([role, layer, str(rank)], float(count))
    yield rows
    imbalance = GaugeMetricFamily(
        "pdserve_moe_imbalance",
        "Busiest rank's rows over the mean, summed over MoE layers "
        "and passes since the last rebalance (1.0: balanced)",
        labels=["role"],
    )
    imbalance.add_metric([role], group["imbalance"])
    yield imbalance
    rebalances = CounterMetricFamily(
        "pdserve_moe_rebalances", "Placements planned by the balancer", labels=["role"]
    )
    rebalances.add_metric([role], float(group["rebalances"]))
    yield rebalances


def serve_http(worker: WorkerView, host: str, port: int) -> ThreadingHTTPServer:
    """Start the side door on a daemon thread; shut it down with .shutdown()."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
            elif self.path == "/experts":  # the same counts as JSON, by layer
                counts = worker.engine.model.expert_counts()
                shown: dict[str, Any] = {"role": worker.role, "layers": counts}
                if worker.lockstep is not None:  # experts over processes: --expert-parallel
                    shown["parallel"] = worker.lockstep.spread()  # or --data-parallel
                    shown["data_parallel"] = worker.lockstep.snapshot()
                self._send(200, json.dumps(shown).encode(), "application/json")
            elif self.path == "/health":
                ok = worker.ready
                self._send(200 if ok else 503, b"ok\n" if ok else b"not ready\n", "text/plain")
            else:
                self._send(404, b"not found\n", "text/plain")

        def do_POST(self) -> None:
            if self.path != "/experts/rebalance":
                self._send(404, b"not found\n", "text/plain")
            elif worker.lockstep is not None:  # every rank plans at one pass
                worker.lockstep.request_rebalance()
                self._send(202, b"rebalance planned at the next forward pass\n", "text/plain")
            else:
                why = b"no experts spread (--expert-parallel 1, --data-parallel 1 or dense)\n"
                self._send(409, why, "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: scrapes are frequent
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
