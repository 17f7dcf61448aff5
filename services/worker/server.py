"""A worker: an engine on its own thread, a KV store, and the RPCs every role answers
(Abort, Health, Load). prefill/ and decode/ add their own RPC and the policies around it.

Errors at the edge: a ValidationError becomes INVALID_ARGUMENT naming the field (or
ALREADY_EXISTS for a request id in use); a store that cannot be reached becomes UNAVAILABLE
where the request cannot do without it, and a recomputation where it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from kvstore.block_hash import ImageSpan, KVLayout
from kvstore.codec import StorageDtype
from kvstore.store import StoreUnavailable
from services.engine.driver import AsyncEngine
from services.engine.engine import Engine
from services.engine.images import PromptImage
from services.engine.outputs import SequenceDelta
from services.engine.params import ValidationError
from services.model import kv_cache
from services.model.allocator import keep_freed_memory
from services.model.causal_lm import CausalLM, MtpLayer
from services.model.config import ModelConfig
from services.model.experts import expert_parallel
from services.model.experts.eplb import Share
from services.model.loader import LoadedModel, load_model, load_mtp
from services.model.loading import sources
from services.model.openmp import release_this_threads_team
from services.model.parallel import data as data_ranks
from services.model.parallel import ranks as tensor_ranks
from services.rpc import keepalive
from services.rpc import worker_pb2 as pb
from services.settings import Settings
from services.tracing import Span, Tracer, from_metadata
from services.worker import convert
from services.worker.chunk_link import ChunkCounters, ChunkLink
from services.worker.fetch_choice import attention_k
from services.worker.images import ImageSource
from services.worker.kv_link import KVLink

Images = tuple[PromptImage, ...]
log = logging.getLogger("pdserve.worker")
WATCH_INTERVAL = 0.5  # seconds between the watchdog's looks at the engine thread
SWITCH_INTERVAL = 0.0005  # seconds; Python's default is 0.005


@dataclass
class Counters:
    recomputed_tokens: int = 0  # prompt tokens computed because the store missed


class Worker:
    role = "worker"

    def __init__(self, settings: Settings) -> None:
        """`settings`: checked (services.settings.check) for this worker's role."""
        self.settings = settings
        # before the model loads and any thread starts: every later thread shares one arena
        keep_freed_memory()
        ms, store = settings.model, settings.store
        loaded = self._load_ranks(settings)
        self.model_name = loaded.config.name
        cache_dtype = loaded.model.dtype
        mc = loaded.config
        self.layout, storage = kv_layout(settings, loaded.path, mc, cache_dtype)
        self.namespace = self.layout.namespace()
        draft: CausalLM | MtpLayer | None = None
        if settings.engine.speculative.draft_model is not None:
            draft = load_model(
                settings.engine.speculative.draft_model, ms.dtype, ms.device, kernels=ms.kernels
            ).model
        elif settings.engine.speculative.method == "mtp":
            model = loaded.model
            draft = load_mtp(
                loaded.path, mc, model.dtype, model.device, model.kernels, ms.deterministic
            )
        self.images = None  # a model that reads images: where its images' rows come from
        if loaded.encoder is not None:
            self.images = ImageSource(loaded.encoder, self.namespace, cache_dtype, store)
        self.link = KVLink(
            self.layout,
            storage,
            store,
            cached_hashes=lambda: self.driver.cached_hashes,
            attention_k=attention_k(mc),
        )
        # block names in the engine = keys in the store; the link moves the requests' KV
        self.engine = Engine(
            loaded.model, loaded.tokenizer, settings.engine, draft, self.namespace, self.link
        )
        self.cache_dtype: torch.dtype = cache_dtype
        # approximate reuse's chunks, shared with the other workers (None: kept here only)
        self.chunks = ChunkLink.of(
            self.engine.reuse, self.engine.runner.kv, self.namespace, store, mc.max_model_len
        )
        release_this_threads_team()  # the engine thread computes from here on (openmp.py)
        rounds = self.lockstep if self.lockstep and not self.lockstep.alone else None
        self.driver = AsyncEngine(self.engine, rounds)
        self.store = self.link.store
        self.counters = Counters()
        self.tracer = Tracer(f"pdserve-{self.role}", settings.server.trace_file)  # None: no-ops
        self.siblings: list[subprocess.Popen[bytes]] = []  # data-parallel ranks started here
        self.serving = False  # between start and drain
        self.exit_code = 0  # 1 once the engine is found dead or stalled
        self._loop: asyncio.AbstractEventLoop | None = None

    async def prompt_images(
        self, prompt: Sequence[int], images: Sequence[pb.Image], later: bool = False
    ) -> tuple[tuple[ImageSpan, ...], tuple[PromptImage, ...], Coroutine[Any, Any, Images] | None]:
        """The prompt's image spans (for its block hashes) and their rows; ValidationError
        ("images") where they do not fit the prompt, a file is bad or the model reads none.
        `later`: where an encoder is making an image's rows (Image.wait_ms) and this worker's
        cache lacks them, the images come without rows (the request queues meanwhile) and
        the third value gets them: waited for in the store, else encoded here."""
        files = [image.data for image in images]
        if not files:
            return (), (), None
        if self.images is None:
            raise ValidationError("images", "the model reads no images")
        spans = self.images.spans(prompt, files)
        waits = [image.wait_ms / 1000 for image in images]
        if later and any(waits):
            at_hand = self.images.at_hand(spans)
            if any(i.embeds is None for i in at_hand):
                return spans, at_hand, self.images.rows(spans, files, waits)
        return spans, await self.images.rows(spans, files), None

    async def give_rows(self, rid: str, later: Coroutine[Any, Any, Images]) -> None:
        """A queued request's images' rows (prompt_images' `later`) given to the engine; the
        request aborted where they cannot be had (ValidationError for a bad image)."""
        try:
            rows = await later
            await self.driver.call(lambda engine: engine.add_rows(rid, rows))
        except BaseException:
            self.driver.abort_soon(rid)
            raise

    def _load_ranks(self, settings: Settings) -> LoadedModel:
        """The model, and the processes it spans: this worker's tensor ranks (the model is
        then rank 0's slice, each pass sent to them) and the data-parallel ranks it steps
        with (a grid of both where both are set)."""
        ms, w, es = settings.model, settings.worker, settings.experts
        ranks = ms.tensor_parallel
        if ranks > 1:  # the cores shared with the ranks this process starts
            torch.set_num_threads(tensor_ranks.threads_per_rank(ranks))
        share = None  # a MoE's experts over processes: this one reads its share of them only
        if w.data_parallel > 1:
            share = Share(w.data_parallel_rank * ranks, w.data_parallel * ranks,
                          es.redundant_experts)  # fmt: skip
        elif es.expert_parallel > 1:
            share = Share(0, es.expert_parallel, es.redundant_experts)
        loaded = load_model(
            ms.model, ms.dtype, ms.device, ms.quantization, ms.kernels, ms.deterministic,
            tensor=(0, ranks), experts=share,
        )  # fmt: skip
        grid = None
        if w.data_parallel > 1:
            balance = data_ranks.Balancing(
                es.redundant_experts, es.eplb_interval, es.eplb_policy, es.eplb_nodes
            )
            grid = data_ranks.Grid(
                w.data_parallel_rank, w.data_parallel, w.data_parallel_address, balance
            )
        if grid is not None and not loaded.model.moe_layers():
            grid = None  # a dense model's ranks are replicas: no exchange, no votes
        self.tensor: tensor_ranks.Leader | None = None  # the other tensor ranks, when split
        self.lockstep: data_ranks.Lockstep | None = None  # the other data-parallel ranks
        self.experts: expert_parallel.ExpertGroup | None = None  # the expert ranks, if started
        if es.expert_parallel > 1:  # rank 0 of data-parallel ranks, the others experts only
            experts = expert_parallel.Spec(
                ms.model, ms.dtype, ms.device, ms.kernels, es.expert_parallel,
                es.redundant_experts, es.eplb_policy, es.eplb_nodes, es.eplb_interval,
            )  # fmt: skip
            self.experts = expert_parallel.start(loaded.model, experts)
            self.lockstep = self.experts.lockstep
            return loaded  # refused beside tensor and data ranks (settings/checks.py)
        if ranks > 1:
            spec = tensor_ranks.Spec(ms.model, ms.dtype, ms.device, ms.kernels, ranks, grid)
            split = tensor_ranks.start(loaded.model, spec)
            self.tensor = split.leader
            if grid is not None:
                self.lockstep = data_ranks.join(split.inner, grid, split.leader.group,
                                                split.leader.empty)  # fmt: skip
            return dataclasses.replace(loaded, model=split)
        if grid is not None:
            self.lockstep = data_ranks.join(loaded.model, grid)
        return loaded

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

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthReply:
        return convert.health_reply(self)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadReply:
        load, images = self.driver.load, self.images.counters if self.images else None
        return pb.LoadReply(
            waiting=load.waiting,
            running=load.running,
            free_blocks=load.free_blocks,
            cached_blocks=load.cached_blocks,
            total_blocks=load.total_blocks,
            tokens_in_flight=load.tokens_in_flight,
            referenced_blocks=load.referenced_blocks,
            recomputed_tokens=self.counters.recomputed_tokens,
            prefix_hit_tokens=load.prefix_hit_tokens,
            approximate_tokens=load.approximate_tokens,
            cached_chunks=load.cached_chunks,
            **dataclasses.asdict(self.chunks.counters if self.chunks else ChunkCounters()),
            **convert.store_load(
                self.store.stats(), images.encoded if images else 0,
                images.store_hits if images else 0,
            ),
        )  # fmt: skip

    # -- serving ---------------------------------------------------------------------

    def add_to_server(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def serve(self) -> int:
        """Serve until SIGTERM or SIGINT; then stop taking requests, give the ones in
        flight `grace_period` seconds, abort the rest; exit code 0. Or until the engine
        thread dies or stalls: then exit at once with 1, for the supervisor to restart us."""
        self._loop = asyncio.get_running_loop()
        self.link.start(self._loop)
        if self.chunks is not None:
            self.chunks.start(self._loop)
        await self.link.probe()  # unreachable: logged, and prompts computed until it answers
        # The engine thread needs the GIL between torch ops, hundreds of times a step; a
        # shorter switch interval bounds its wait when RPCs (a KV fetch) run Python meanwhile.
        sys.setswitchinterval(SWITCH_INTERVAL)
        self.driver.start()
        # no SO_REUSEPORT: a port another server holds is an error here, not a silent share
        # of its connections (a prefill worker answering a decode worker's calls)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *keepalive.SERVER_OPTIONS])
        self.add_to_server(server)
        address = f"{self.settings.server.host}:{self.settings.port}"
        server.add_insecure_port(address)
        await server.start()
        side_door = None
        metrics_port = self.settings.worker.metrics_port
        if metrics_port is not None:
            from services.worker.http import serve_http

            side_door = serve_http(self, self.settings.server.host, metrics_port)
        self.serving = True
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, stop.set)
        if os.environ.get("PDSERVE_TEST_HOOKS") == "1":  # tests: SIGUSR1 kills the engine thread
            self._loop.add_signal_handler(signal.SIGUSR1, self.driver.kill)
        watchdog = asyncio.create_task(self._watch(stop))
        log.warning(
            "serving",
            extra={"fields": {"role": self.role, "address": address, "namespace": self.namespace}},
        )
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
            grace = self.settings.worker.grace_period
            log.warning("draining", extra={"fields": {"grace_seconds": grace}})
            await server.stop(grace)
            await self.driver.abort_all()
            await self.driver.stop()
            await self.link.flush(grace)  # the blocks computed reach the store
            if self.chunks is not None:
                await self.chunks.flush(grace)
        dead = bool(self.exit_code) or self.driver.failure is not None
        for ranks in (self.experts, self.tensor):  # the engine thread is stopped, or dead
            if ranks is not None:
                ranks.stop(kill=dead)
        with contextlib.suppress(StoreUnavailable):
            await self.store.close()
            if self.chunks is not None:
                await self.chunks.close()
        if side_door is not None:
            side_door.shutdown()
        return self.exit_code

    async def _watch(self, stop: asyncio.Event) -> None:
        """The watchdog: an engine thread that died, or made no step for
        `engine_stall_timeout` seconds with work queued, stops the worker (exit code 1)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            why = (
                self.driver.failure
                or (self.experts and self.experts.lost())
                or (self.tensor and self.tensor.lost())
                or next((f"data-parallel rank {r} exited" for r, p in
                         enumerate(self.siblings, start=1) if p.poll() is not None), None)
            )  # fmt: skip
            stalled = self.driver.stalled_for()
            if why is None and stalled > self.settings.worker.engine_stall_timeout:
                why = f"no engine step for {stalled:.0f}s with requests queued"
            if why is not None:
                log.critical("engine down: exiting for a restart", extra={"fields": {"why": why}})
                self.exit_code = 1
                stop.set()
                return


def kv_layout(
    settings: Settings, path: Path, config: ModelConfig, dtype: torch.dtype
) -> tuple[KVLayout, StorageDtype]:
    """The layout of the blocks a worker of these settings stores (its namespace: what every
    worker and encoder of a deployment must agree on), and their storage dtype."""
    store = settings.store
    storage = StorageDtype.parse(
        str(dtype).removeprefix("torch.")
        if store.kv_store_dtype == "auto"
        else store.kv_store_dtype
    )
    weights_id = sources.fingerprint(path)  # quantized weights compute other KV
    if settings.model.quantization != "none":
        weights_id += f"+{settings.model.quantization}"
    layout = kv_cache.layout(weights_id, storage.name.lower(), settings.engine.block_size, config)
    return layout, storage


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
    span.event(
        "step",
        s.start_ns,
        forward_ms=(s.forward_end_ns - s.start_ns) / 1e6,
        seqs=s.num_seqs,
        tokens=s.num_tokens,
    )
