"""A worker: an engine on its own thread, a KV store, and the RPCs every role answers
(Abort, Health, Load). prefill/ and decode/ add their own RPC and the policies around it.

Errors at the edge: a ValidationError becomes INVALID_ARGUMENT naming the field (or
ALREADY_EXISTS for a request id in use); a store that cannot be reached becomes UNAVAILABLE
where the request cannot do without it, and a recomputation where it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kvstore.block_hash import BLOCK_SIZE, KVLayout
from kvstore.codec import StorageDtype
from kvstore.store import StoreUnavailable
from services.engine.driver import AsyncEngine
from services.engine.engine import Engine, EngineConfig
from services.engine.outputs import SequenceDelta
from services.engine.params import ValidationError
from services.engine.speculative import METHODS, SpeculativeConfig
from services.model import sources
from services.model.loader import load_model
from services.model.openmp import release_this_threads_team
from services.rpc import worker_pb2 as pb
from services.settings import DEFAULTS, Settings, SettingsError
from services.tracing import Span, Tracer, from_metadata
from services.worker.kv_link import KVLink

log = logging.getLogger("pdserve.worker")
WATCH_INTERVAL = 0.5  # seconds between the watchdog's looks at the engine thread
SWITCH_INTERVAL = 0.0005  # seconds; Python's default is 0.005


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker runs with; defaults and meanings: services/settings.py."""

    role: str  # "prefill" or "decode"
    host: str = DEFAULTS.host
    port: int = 50051
    model: str = DEFAULTS.model
    dtype: str = DEFAULTS.dtype
    device: str = DEFAULTS.device
    quantization: str = DEFAULTS.quantization
    kernels: str = DEFAULTS.kernels
    cuda_graph_max_batch: int = DEFAULTS.cuda_graph_max_batch
    kv_store: str = DEFAULTS.kv_store
    kv_store_dtype: str = DEFAULTS.kv_store_dtype
    kv_store_max_bytes: int | None = None  # cap of a local:// or memory:// store (LRU)
    store_timeout: float = DEFAULTS.store_timeout
    num_blocks: int | None = None  # KV pool size; None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = int(DEFAULTS.kv_cache_gb * (1 << 30))
    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens
    prefill_chunk_size: int | None = None  # None: min(256, max_num_batched_tokens)
    grace_period: float = DEFAULTS.grace_period
    stall_timeout: float = 60.0  # seconds without an engine step, work queued: the worker exits
    write_back: bool = DEFAULTS.write_back
    metrics_port: int | None = None  # HTTP /metrics and /health (services/worker/http.py)
    # the deployment's secret: stored blocks carry a MAC made with it (kvstore/codec.py);
    # None: a checksum only
    kv_key: bytes | None = field(default=None, repr=False)
    trace_file: str | None = None  # OpenTelemetry spans appended here (services/tracing.py)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding


def worker_config(s: Settings, role: str) -> WorkerConfig:
    """A worker's part of the settings; a bad key file or store directory is refused here,
    before the model loads."""
    from kvstore.keyfile import read_key
    from kvstore.local import path_of, private_dir

    try:
        kv_key = read_key(s.kv_key_file) if s.kv_key_file else None
        if s.kv_store.startswith("local:"):
            private_dir(path_of(s.kv_store))
    except (OSError, ValueError) as e:
        raise SettingsError(str(e)) from e
    return WorkerConfig(
        role=role, host=s.host, port=s.port_for(role), model=s.model, dtype=s.dtype,
        device=s.device, quantization=s.quantization, kernels=s.kernels,
        cuda_graph_max_batch=s.cuda_graph_max_batch, kv_store=s.kv_store,
        kv_store_dtype=s.kv_store_dtype,
        kv_store_max_bytes=int(s.kv_store_max_gb * (1 << 30)), store_timeout=s.store_timeout,
        num_blocks=s.num_blocks, kv_cache_bytes=int(s.kv_cache_gb * (1 << 30)),
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
        prefill_chunk_size=s.prefill_chunk_size,
        grace_period=s.grace_period, write_back=s.write_back, metrics_port=s.metrics_port,
        stall_timeout=s.engine_stall_timeout, kv_key=kv_key, trace_file=s.trace_file,
        speculative=speculative_config(s),
    )  # fmt: skip


def speculative_config(s: Settings) -> SpeculativeConfig | None:
    """The speculative settings, or SettingsError naming what is wrong."""
    if s.speculative == "none":
        return None
    method, _, draft = s.speculative.partition(":")
    if method not in METHODS or (method == "draft") != bool(draft):
        raise SettingsError(
            f"speculative: {s.speculative!r} is not none, ngram, suffix or draft:MODEL"
        )
    return SpeculativeConfig(
        method, s.num_speculative_tokens, s.speculative_max_batch, draft_model=draft or None
    )


@dataclass
class Counters:
    recomputed_tokens: int = 0  # prompt tokens computed because the store missed


class Worker:
    role = "worker"

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        loaded = load_model(
            config.model, config.dtype, config.device, config.quantization, config.kernels
        )
        self.model_name = loaded.config.name
        cache_dtype = loaded.model.dtype
        storage = (
            StorageDtype.parse(str(cache_dtype).removeprefix("torch."))
            if config.kv_store_dtype == "auto"
            else StorageDtype.parse(config.kv_store_dtype)
        )
        mc = loaded.config
        weights_id = sources.fingerprint(loaded.path)  # quantized weights compute other KV
        if config.quantization != "none":
            weights_id += f"+{config.quantization}"
        self.layout = KVLayout(
            weights_id, storage.name.lower(), BLOCK_SIZE,
            mc.num_layers, mc.num_kv_heads, mc.head_dim,
        )  # fmt: skip
        self.namespace = self.layout.namespace()
        engine_config = EngineConfig(
            block_size=self.layout.block_size,
            num_blocks=config.num_blocks,
            kv_cache_bytes=config.kv_cache_bytes,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_chunk_size=config.prefill_chunk_size,
            model_id=self.layout.model_id,
            namespace=self.namespace,  # block names in the engine = keys in the store
            speculative=config.speculative,
            cuda_graph_max_batch=config.cuda_graph_max_batch,
        )
        draft = None
        if config.speculative is not None and config.speculative.draft_model is not None:
            draft = load_model(
                config.speculative.draft_model, config.dtype, config.device, kernels=config.kernels
            ).model
        self.engine = Engine(loaded.model, loaded.tokenizer, engine_config, draft)
        self.cache_dtype: torch.dtype = cache_dtype
        release_this_threads_team()  # the engine thread computes from here on (openmp.py)
        self.driver = AsyncEngine(self.engine)
        self.link = KVLink(
            self.layout, storage, config.kv_store, key=config.kv_key,
            timeout=config.store_timeout, max_bytes=config.kv_store_max_bytes,
            cache=self.engine.kv, cached_hashes=lambda: self.driver.cached_hashes,
        )  # fmt: skip
        self.store = self.link.store
        self.counters = Counters()
        self.tracer = Tracer(f"pdserve-{self.role}", config.trace_file)  # None: no-ops
        self.serving = False  # between start and drain
        self.exit_code = 0  # 1 once the engine is found dead or stalled
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ready(self) -> bool:
        """Serving, with an engine that is alive (what Health and HTTP /health report)."""
        return self.serving and self.driver.alive

    def span(self, name: str, context: Any, **attributes: Any) -> Span:
        """The RPC's server span, in the caller's trace when it sent a traceparent."""
        if not self.tracer.enabled:
            return self.tracer.start(name, None)
        return self.tracer.start(name, from_metadata(context.invocation_metadata()), **attributes)

    # -- the RPCs both roles answer -------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortReply:
        found = await self.driver.abort(request.request_id)
        log.info("abort", extra={"fields": {"request_id": request.request_id, "found": found}})
        return pb.AbortReply(found=found)

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthReply:
        return pb.HealthReply(
            role=self.role, model=self.model_name, ready=self.ready, namespace=self.namespace,
            block_size=self.layout.block_size,
        )  # fmt: skip

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadReply:
        load, stats = self.driver.load, self.store.stats()
        return pb.LoadReply(
            waiting=load.waiting,
            running=load.running,
            free_blocks=load.free_blocks,
            cached_blocks=load.cached_blocks,
            total_blocks=load.total_blocks,
            tokens_in_flight=load.tokens_in_flight,
            referenced_blocks=load.referenced_blocks,
            recomputed_tokens=self.counters.recomputed_tokens,
            store_hits=stats.hits - stats.corrupt,
            store_corrupt=stats.corrupt,
            store_unavailable=stats.unavailable,
        )

    # -- serving ---------------------------------------------------------------------

    def add_to_server(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def serve(self) -> int:
        """Serve until SIGTERM or SIGINT; then stop taking requests, give the ones in
        flight `grace_period` seconds, abort the rest; exit code 0. Or until the engine
        thread dies or stalls: then exit at once with 1, for the supervisor to restart us."""
        self._loop = asyncio.get_running_loop()
        self.link.start(self._loop)
        # The engine thread needs the GIL between torch ops, hundreds of times a step; a
        # shorter switch interval bounds its wait when RPCs (a KV fetch) run Python meanwhile.
        sys.setswitchinterval(SWITCH_INTERVAL)
        self.driver.start()
        server = grpc.aio.server()
        self.add_to_server(server)
        address = f"{self.config.host}:{self.config.port}"
        server.add_insecure_port(address)
        await server.start()
        side_door = None
        if self.config.metrics_port is not None:
            from services.worker.http import serve_http

            side_door = serve_http(self, self.config.host, self.config.metrics_port)
        self.serving = True
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, stop.set)
        if os.environ.get("PDSERVE_TEST_HOOKS") == "1":  # tests: SIGUSR1 kills the engine thread
            self._loop.add_signal_handler(signal.SIGUSR1, self.driver.kill)
        watchdog = asyncio.create_task(self._watch(stop))
        log.warning("serving", extra={"fields": {"role": self.role, "address": address,
                                                  "namespace": self.namespace}})  # fmt: skip
        await stop.wait()
        watchdog.cancel()
        # On the way out for good: a second signal (a supervisor repeating its SIGTERM) must
        # not kill the process with the default action once the loop has closed.
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        self.serving = False
        if self.exit_code:  # the engine cannot finish anything: no grace, no aborts
            await server.stop(0)
        else:
            log.warning("draining", extra={"fields": {"grace_seconds": self.config.grace_period}})
            await server.stop(self.config.grace_period)
            await self.driver.abort_all()
            await self.driver.stop()
        with contextlib.suppress(StoreUnavailable):
            await self.store.close()
        if side_door is not None:
            side_door.shutdown()
        return self.exit_code

    async def _watch(self, stop: asyncio.Event) -> None:
        """The watchdog: an engine thread that died, or made no step for `stall_timeout`
        seconds with work queued, stops the worker (exit code 1)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            why = self.driver.failure
            stalled = self.driver.stalled_for()
            if why is None and stalled > self.config.stall_timeout:
                why = f"no engine step for {stalled:.0f}s with requests queued"
            if why is not None:
                log.critical("engine down: exiting for a restart", extra={"fields": {"why": why}})
                self.exit_code = 1
                stop.set()
                return


async def refuse(context: Any, error: ValidationError) -> None:
    """Abort the RPC for a request the worker will not run."""
    duplicate = error.field == "request_id"
    code = grpc.StatusCode.ALREADY_EXISTS if duplicate else grpc.StatusCode.INVALID_ARGUMENT
    await context.abort(code, str(error))


def trace_steps(span: Span, delta: SequenceDelta, first: bool) -> None:
    """The engine's side of a delta as span events: when the sequence left the queue (with
    its first delta), and the step that made the token (its start; ms of the forward pass and
    of the whole step, sequences and tokens in it)."""
    if not span.recording or delta.step is None:
        return
    if first and delta.scheduled_ns:
        span.event("scheduled", delta.scheduled_ns)
    s = delta.step
    span.event("step", s.start_ns, forward_ms=(s.forward_end_ns - s.start_ns) / 1e6,
               seqs=s.num_seqs, tokens=s.num_tokens)  # fmt: skip
