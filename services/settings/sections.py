"""Every setting of every pdserve service, declared once: its type, default, help and the
roles that take it, grouped in the sections the code is built from.

A section is the object its user takes whole: the engine an `EngineConfig`, a worker's store
link a `StoreSettings`, the router a `RouterSettings`; nothing copies a section's fields into
another object. `Settings` is one role's whole set (services/settings/loading.py fills it
from defaults, a TOML file, the environment and flags; names are flat there: `max_num_seqs`,
`PDSERVE_MAX_NUM_SEQS`, `--max-num-seqs`).

A field with `setting(...)` metadata is a setting; other fields (`EngineConfig.block_size`)
are fixed by the code that builds the section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.block_hash import BLOCK_SIZE
from services.settings.fields import (
    DEFAULT_PORTS,
    ENCODE,
    EVERY,
    GIB,
    OFFLINE,
    ROLES,
    ROUTER,
    SECRETS,
    SPECULATIVE_METHODS,
    WORKER,
    Section,
    SettingsError,
    setting,
)

__all__ = ["DEFAULT_PORTS", "GIB", "ROLES", "ROUTER", "SECRETS", "WORKER", "SettingsError"]


@dataclass(frozen=True)
class ServerSettings(Section):
    host: str = setting("127.0.0.1", "address to listen on", EVERY)
    port: int | None = setting(None, "port (default: router 8000, prefill 50051, decode 50052, "
                               "encode 50053)",
                               EVERY)  # fmt: skip
    trace_file: str | None = setting(None, "append OpenTelemetry spans of every request to this "
                                     "file (OTLP/JSON lines; bench/timeline.py reads them); "
                                     "unset: no tracing", EVERY)  # fmt: skip
    log_level: str = setting("warning", "debug, info, warning or error", EVERY,
                             choices=("debug", "info", "warning", "error"))  # fmt: skip


@dataclass(frozen=True)
class ModelSettings(Section):
    model: str = setting("embedded", 'model: "embedded" (SmolLM2-135M-Instruct), a .gguf file '
                         "or a Hugging Face directory", (*EVERY, *OFFLINE))  # fmt: skip
    dtype: str = setting("auto", "compute dtype; auto = bfloat16 where the CPU has bf16 units",
                         (*ENCODE, *OFFLINE),
                         choices=("auto", "float32", "bfloat16", "float16"))  # fmt: skip
    device: str = setting("auto", "auto, cpu or cuda[:N]", (*ENCODE, *OFFLINE))
    kernels: str = setting("auto", "attention and layer kernels: auto (Triton on CUDA, C on "
                           "CPUs), c, torch, or triton (on a CPU: Triton's interpreter, for "
                           "tests)", (*WORKER, *OFFLINE),
                           choices=("auto", "c", "torch", "triton"))  # fmt: skip
    deterministic: bool = setting(True, "on a GPU, products whose rows do not depend on the "
                                  "batch (a Triton GEMM with one summation order instead of "
                                  "cuBLAS): a request's tokens whatever it is batched with, "
                                  "as on CPUs (where products always are)",
                                  (*WORKER, *OFFLINE))  # fmt: skip
    quantization: str = setting("none", "int8: the decoder layers' q/k/v, o and gate/up "
                                "products in int8, weights and activations (CPUs; fast with "
                                "VNNI or AMX; perplexity +0.3%, docs/benchmarks.md)",
                                (*ENCODE, *OFFLINE), choices=("none", "int8"))  # fmt: skip
    tensor_parallel: int = setting(1, "processes each layer is split over by its output "
                                   "columns (heads, MLP columns, vocabulary), the worker and "
                                   "N - 1 ranks it starts; answers equal one process's, bit "
                                   "for bit (docs/parallel.md; dense Llama-family models)",
                                   WORKER, minimum=1)  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig(Section):
    """Speculative decoding (services/engine/speculative.py)."""

    speculative: str = setting("none", "speculative decoding: ngram (prompt lookup), suffix "
                               "(also over recent outputs), draft:MODEL (a smaller model with "
                               "the same tokenizer: .gguf or Hugging Face directory), mtp (a "
                               "DeepSeek-V3 or V4 checkpoint's own multi-token-prediction "
                               "layer) or none", WORKER)  # fmt: skip
    num_tokens: int = setting(4, "tokens proposed per step, at most", WORKER, minimum=1,
                              name="num_speculative_tokens")  # fmt: skip
    max_batch: int = setting(4, "running sequences above which nothing is proposed "
                             "(verifying costs more than it saves)", WORKER, minimum=0,
                             name="speculative_max_batch")  # fmt: skip
    min_n: int = 2  # shortest n-gram matched
    max_n: int = 4  # longest n-gram matched (the longest match is tried first)
    index_tokens: int = 1 << 16  # suffix: tokens of recent outputs kept in the index

    def __post_init__(self) -> None:
        super().__post_init__()
        known = self.speculative == "none" or self.method in SPECULATIVE_METHODS
        if not known or (self.method != "draft" and self.draft_model is not None):
            raise SettingsError(self.malformed)
        if self.num_tokens < 1 or not 1 <= self.min_n <= self.max_n:
            raise SettingsError("speculative: num_tokens >= 1 and 1 <= min_n <= max_n")

    @property
    def malformed(self) -> str:
        return f"speculative: {self.speculative!r} is not none, ngram, suffix, draft:MODEL or mtp"

    @property
    def enabled(self) -> bool:
        return self.speculative != "none"

    @property
    def method(self) -> str:
        """ngram, suffix, draft (the engine is given the draft model) or mtp (the checkpoint's
        MTP layer); none: off."""
        return self.speculative.partition(":")[0]

    @property
    def draft_model(self) -> str | None:
        """draft:MODEL's MODEL, which the worker loads."""
        return self.speculative.partition(":")[2] or None


@dataclass(frozen=True)
class ReuseConfig(Section):
    """Approximate KV reuse (services/engine/chunk_reuse.py)."""

    kv_reuse: str = setting("exact", "KV reuse of a request that does not say (`kv_reuse` in "
                            "its body): exact (cached prefixes only) or approximate (also the "
                            "chunks it marks, found where another prompt computed them: keys "
                            "re-rotated, a share of their tokens recomputed; answers may "
                            "differ from full computation)", WORKER,
                            choices=("exact", "approximate"))  # fmt: skip
    requests: bool = setting(True, "requests may choose their KV reuse (`kv_reuse` in the body); "
                             "off: a request naming one other than --kv-reuse is refused",
                             WORKER, name="kv_reuse_requests")  # fmt: skip
    ratio: float = setting(0.3, "approximate reuse: share of a reused chunk's tokens recomputed "
                           "from layer 1 on, those whose values deviate most (docs/benchmarks.md "
                           "measures it)", WORKER, minimum=0.0, name="kv_reuse_ratio")  # fmt: skip
    min_tokens: int = setting(16, "approximate reuse: the shortest chunk stored and looked up, "
                              "in tokens", WORKER, minimum=1,
                              name="kv_reuse_min_tokens")  # fmt: skip
    cache_gb: float = setting(1.0, "approximate reuse: GiB of chunks' K/V a worker keeps (least "
                              "recently used dropped first)", WORKER, minimum=0.0,
                              name="kv_reuse_cache_gb")  # fmt: skip
    check_layer: int = 1  # the layer where the recomputed tokens are chosen (CacheBlend's)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratio > 1:
            raise SettingsError(f"kv_reuse_ratio: a share, at most 1, got {self.ratio}")


@dataclass(frozen=True)
class EngineConfig(Section):
    """The engine's sizes and policies (services/engine/engine.py)."""

    num_blocks: int | None = setting(None, "KV blocks in a worker's pool", WORKER, minimum=1)
    kv_cache_gb: float | None = setting(None, "KV pool size in GiB when --num-blocks is not "
                                        "given (default: 1 on a CPU; on CUDA what "
                                        "--gpu-memory-utilization leaves)", WORKER)  # fmt: skip
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory the worker may use "
                                            "(weights, activations, KV pool) when neither "
                                            "--num-blocks nor --kv-cache-gb sizes the pool "
                                            "(CUDA only)", WORKER)  # fmt: skip
    max_num_seqs: int = setting(64, "sequences a worker runs at once", WORKER, minimum=1)
    max_num_batched_tokens: int = setting(512, "tokens per engine step", WORKER, minimum=1)
    prefill_chunk_size: int | None = setting(None, "a prompt's tokens per engine step, at most "
                                             "(default: min(256, tokens per step))", WORKER,
                                             minimum=1)  # fmt: skip
    cuda_graph_max_batch: int = setting(256, "decode steps of up to this many sequences "
                                        "replay CUDA graphs captured per batch-size bucket "
                                        "(CUDA only; 0: off)", WORKER)  # fmt: skip
    async_scheduling: str = setting("auto", "schedule the next step and build its inputs while "
                                    "the model computes this one (its tokens fed to the next on "
                                    "the device): on, off, auto (on with CUDA)", WORKER,
                                    choices=("auto", "on", "off"))  # fmt: skip
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    block_size: int = BLOCK_SIZE  # tokens per KV block: part of every block's hash
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_chunk_size is not None and (
            self.prefill_chunk_size > self.max_num_batched_tokens
        ):
            raise SettingsError(
                f"prefill_chunk_size ({self.prefill_chunk_size}) must not exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise SettingsError("gpu_memory_utilization: must be in (0, 1]")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise SettingsError("kv_cache_gb: must be above 0")

    @property
    def chunk_size(self) -> int:
        """Tokens of one prompt per step, at most."""
        return self.prefill_chunk_size or min(256, self.max_num_batched_tokens)


@dataclass(frozen=True)
class StoreSettings(Section):
    """A worker's KV store (services/worker/kv_link.py)."""

    kv_store: str = setting("local://", "KV store: local://[PATH], memory://, redis://...",
                            ENCODE)  # fmt: skip
    kv_store_dtype: str = setting("auto", "stored blocks' dtype: auto, float32, float16, "
                                  "bfloat16, fp8", ENCODE)  # fmt: skip
    kv_store_max_gb: float = setting(8.0, "size cap of a local:// store (least recently used "
                                     "blocks go first)", ENCODE)  # fmt: skip
    store_timeout: float = setting(1.0, "seconds per store call before it counts as down",
                                   ENCODE)  # fmt: skip
    kv_fetch: str = setting("auto", "a prompt's blocks in the store: auto (read, computed, "
                            "or the first computed while the rest is read: whichever the "
                            "measured link and prompt rate make soonest), always, never",
                            WORKER, choices=("auto", "always", "never"))  # fmt: skip
    kv_key_file: str | None = setting(None, "file holding the secret every worker of the "
                                      "deployment shares: stored blocks carry a MAC made with "
                                      "it (none: a checksum only)", ENCODE)  # fmt: skip

    @property
    def max_bytes(self) -> int:
        """The cap of a local:// or memory:// store (least recently used blocks go first)."""
        return int(self.kv_store_max_gb * GIB)


@dataclass(frozen=True)
class WorkerSettings(Section):
    """A worker process around its engine (services/worker/server.py)."""

    grace_period: float = setting(10.0, "seconds in-flight requests get on SIGTERM", ENCODE)
    engine_stall_timeout: float = setting(60.0, "seconds without an engine step while requests "
                                          "wait before a worker exits (for a restart)",
                                          WORKER)  # fmt: skip
    write_back: bool = setting(True, "decode: write finished generations' blocks to the store",
                               WORKER)  # fmt: skip
    metrics_port: int | None = setting(None, "workers: serve Prometheus /metrics and /health "
                                       "over HTTP on this port (up: worker k on this port + "
                                       "k, prefill workers first)", WORKER)  # fmt: skip
    data_parallel: int = setting(1, "data-parallel ranks: N workers, each a whole engine "
                                 "with its own requests and a routing target; a MoE model's "
                                 "routed experts spread over all of them and exchanged "
                                 "all-to-all at every MoE layer, a dense model's ranks "
                                 "replicas (docs/parallel.md; up: each worker becomes N ranks)",
                                 WORKER, minimum=1)  # fmt: skip
    data_parallel_rank: int = setting(0, "this worker's rank among --data-parallel N (up sets "
                                      "it)", WORKER, minimum=0)  # fmt: skip
    data_parallel_address: str = setting("", "host:port where rank 0 of the data-parallel "
                                         "ranks meets the others (up sets it)",
                                         WORKER)  # fmt: skip


@dataclass(frozen=True)
class ExpertSettings(Section):
    """A MoE model's experts over processes and their balancer (services/model/
    expert_parallel.py, eplb.py)."""

    expert_parallel: int = setting(1, "processes a MoE model's routed experts are spread over: "
                                   "the worker and N - 1 expert ranks it starts (gloo on CPUs, "
                                   "NCCL on GPUs, a GPU each)", WORKER, minimum=1)  # fmt: skip
    redundant_experts: int = setting(0, "expert slots per MoE layer beyond one per expert, for "
                                     "the balancer's second copies of hot experts (experts + "
                                     "redundant must divide by --expert-parallel)", WORKER,
                                     minimum=0)  # fmt: skip
    eplb_interval: int = setting(0, "forward passes between rebalances of the experts' "
                                 "placement, from the load since the last (0: only on POST "
                                 "/experts/rebalance to the metrics port)", WORKER,
                                 minimum=0)  # fmt: skip
    eplb_policy: str = setting("auto", "hierarchical (expert groups packed onto nodes first), "
                               "global, or auto (hierarchical where --eplb-nodes > 1 divides "
                               "the groups and ranks)", WORKER,
                               choices=("auto", "hierarchical", "global"))  # fmt: skip
    eplb_nodes: int = setting(1, "nodes the expert ranks span, for the hierarchical policy",
                              WORKER, minimum=1)  # fmt: skip


@dataclass(frozen=True)
class RouterSettings(Section):
    """The router (router/)."""

    served_model_name: str | None = setting(None, "the model id clients send", ROUTER)
    prefill: tuple[str, ...] = setting((), "prefill workers, HOST:PORT (router)", ("router",))
    decode: tuple[str, ...] = setting((), "decode workers, HOST:PORT (router)", ("router",))
    encode: tuple[str, ...] = setting((), "encode workers, HOST:PORT: a prompt's images are "
                                      "encoded there first (none: by the worker computing the "
                                      "prompt)", ("router",))  # fmt: skip
    policy: str = setting("kv_aware", "routing policy", ROUTER,
                          choices=("round_robin", "least_load", "kv_aware"))  # fmt: skip
    imbalance: int = setting(8, "kv_aware: requests a cached worker may be busier by", ROUTER)
    disagg_threshold: int = setting(0, "prompts with fewer uncached tokens skip prefill (0: off)",
                                    ROUTER)  # fmt: skip
    prefetch_tokens: int = setting(1024, "prompts with at least this many tokens a decode "
                                   "worker lacks are read by it while prefill computes them "
                                   "(0: after)", ROUTER, minimum=0)  # fmt: skip
    api_keys: tuple[str, ...] = setting((), "accepted API keys (none: no authentication); "
                                        "prefer the variable or --api-keys-file: flags show "
                                        "in ps", ROUTER)  # fmt: skip
    api_keys_file: str | None = setting(None, "file of accepted API keys, one per line "
                                        "(added to --api-keys)", ROUTER)  # fmt: skip
    admin_key: str | None = setting(None, "key for /admin/workers (none: admin API off)", ROUTER)
    admin_key_file: str | None = setting(None, "file holding the admin key", ROUTER)
    max_pending: int = setting(256, "sequences (prompts x n) in flight before 429", ROUTER,
                               minimum=1)  # fmt: skip
    max_prompts: int = setting(64, "prompts one completions request may carry", ROUTER,
                               minimum=1)  # fmt: skip
    max_n: int = setting(16, "largest n (choices per prompt)", ROUTER, minimum=1)
    max_body_bytes: int = setting(32 << 20, "largest request body (413 past it; images "
                                  "come in it, base64)", ROUTER)  # fmt: skip
    max_images_per_request: int = setting(8, "images one request may carry (400 past it)",
                                          ROUTER, minimum=0)  # fmt: skip
    max_image_bytes: int = setting(10 << 20, "largest image file (400 past it)", ROUTER,
                                   minimum=1)  # fmt: skip
    max_image_pixels: int = setting(32 << 20, "most pixels in an image, read from its header "
                                    "before decoding (400 past it)", ROUTER,
                                    minimum=1)  # fmt: skip
    allowed_local_media_path: str | None = setting(None, "a directory whose files requests may "
                                                   "name as file:// image URLs (none: refused)",
                                                   ROUTER)  # fmt: skip
    allowed_media_domains: tuple[str, ...] = setting((), "hosts whose http(s) image URLs the "
                                                     "router fetches (none: remote URLs "
                                                     "refused)", ROUTER)  # fmt: skip
    media_fetch_timeout: float = setting(10.0, "seconds fetching a remote image may take",
                                         ROUTER, minimum=0)  # fmt: skip
    encode_timeout: float = setting(30.0, "seconds an Encode may take before another encoder "
                                    "is tried (none left: the prompt's worker encodes)",
                                    ROUTER, minimum=0)  # fmt: skip
    health_interval: float = setting(1.0, "seconds between worker health checks (a worker not "
                                     "healthy is asked every 0.25 s)", ROUTER)  # fmt: skip
    health_timeout: float = setting(5.0, "seconds a worker's health check may take (a busy "
                                    "worker answers late)", ROUTER)  # fmt: skip
    health_failures: int = setting(3, "health checks unanswered in a row before a worker is "
                                   "left out (a refused connection: at once; one success "
                                   "brings it back)", ROUTER,
                                   minimum=1)  # fmt: skip
    prefill_timeout: float = setting(120.0, "seconds a Prefill may take before another worker "
                                     "is tried", ROUTER)  # fmt: skip
    retry_wait: float = setting(30.0, "seconds a request waits for a worker to come back when "
                                "every one has failed it, or none of a role is available",
                                ROUTER)  # fmt: skip
    ttft_slo: float = setting(0.0, "seconds a prompt may be expected to wait for its first "
                              "token: past it, computed by a decode worker with room or refused "
                              "(429 + Retry-After); 0: no limit", ROUTER, minimum=0)  # fmt: skip
    responses_stored: int = setting(1024, "Responses API: responses kept for "
                                    "previous_response_id and GET (the oldest dropped past it; "
                                    "0: none kept)", ROUTER, minimum=0)  # fmt: skip
    responses_ttl: float = setting(3600.0, "Responses API: seconds a stored response can be "
                                   "read back", ROUTER, minimum=0)  # fmt: skip


@dataclass(frozen=True)
class UpSettings(Section):
    """`pdserve up`'s stack (services/up.py)."""

    num_prefill: int = setting(1, "prefill workers to start", ("up",), minimum=1)
    num_decode: int = setting(1, "decode workers to start", ("up",), minimum=1)
    num_encode: int = setting(0, "encode workers to start (a model that reads images; 0: the "
                              "worker computing a prompt encodes its images)", ("up",),
                              minimum=0)  # fmt: skip
    colocated: bool | None = setting(None, "no prefill workers: each decode worker computes "
                                     "prompts too, in one engine; unset: chosen by the host's "
                                     "cores (colocated below 8, where the two roles' processes "
                                     "would share cores)", ("up",))  # fmt: skip
    redis: bool = setting(False, "start a redis-server child as the KV store", ("up",))
    redis_max_memory: str = setting("2gb", "--redis: the redis-server's memory cap (least "
                                    "recently used blocks evicted past it)", ("up",))  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What one role runs with: every section (a role reads the ones it uses)."""

    role: str = "up"  # router, prefill, decode or up: whose defaults fill the gaps (port)
    server: ServerSettings = field(default_factory=ServerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineConfig = field(default_factory=EngineConfig)
    store: StoreSettings = field(default_factory=StoreSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    experts: ExpertSettings = field(default_factory=ExpertSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    up: UpSettings = field(default_factory=UpSettings)

    @property
    def port(self) -> int:
        """The port set, else the role's own default."""
        return self.server.port if self.server.port is not None else DEFAULT_PORTS[self.role]


DEFAULTS = Settings()  # the defaults, for code that takes one setting as an argument
