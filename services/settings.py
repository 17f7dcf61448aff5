"""One settings model for every pdserve service (router, prefill, decode, up).

A setting's value comes from, lowest first: its default; a TOML config file (`--config` or
`PDSERVE_CONFIG`; top-level keys for every role, and tables `[router]`, `[prefill]`,
`[decode]`, `[up]` for one); an environment variable `PDSERVE_<NAME>`; a command-line flag
`--<name>`. `pdserve config show` prints the values in effect and where each came from.

Lists (worker addresses, API keys) are comma-separated in the environment, lists or strings
in the file, and repeated or comma-separated flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("router", "prefill", "decode", "up")
WORKER = ("prefill", "decode", "up")
ROUTER = ("router", "up")
EVERY = ROLES
DEFAULT_PORTS = {"router": 8000, "prefill": 50051, "decode": 50052, "up": 8000}
SECRETS = ("api_keys", "admin_key")  # shown as <set>
MODEL_HELP = 'model: "embedded" (SmolLM2-135M-Instruct), a .gguf file or a Hugging Face directory'


class SettingsError(ValueError):
    """A value that cannot be used; the message names where it came from."""


def setting(default: Any, help: str, roles: Sequence[str], **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "roles": tuple(roles), **extra})


@dataclass(frozen=True)
class Settings:
    # every service
    host: str = setting("127.0.0.1", "address to listen on", EVERY)
    port: int | None = setting(None, "port (default: router 8000, prefill 50051, decode 50052)",
                               EVERY)  # fmt: skip
    model: str = setting("embedded", MODEL_HELP, EVERY)
    trace_file: str | None = setting(None, "append OpenTelemetry spans of every request to this "
                                     "file (OTLP/JSON lines; bench/timeline.py reads them); "
                                     "unset: no tracing", EVERY)  # fmt: skip
    log_level: str = setting("warning", "debug, info, warning or error", EVERY,
                             choices=("debug", "info", "warning", "error"))  # fmt: skip
    # workers
    dtype: str = setting("auto", "compute dtype; auto = bfloat16 where the CPU has bf16 units",
                         WORKER, choices=("auto", "float32", "bfloat16", "float16"))  # fmt: skip
    device: str = setting("auto", "auto, cpu or cuda[:N]", WORKER)
    kernels: str = setting("auto", "attention and layer kernels: auto (Triton on CUDA, C on "
                           "CPUs), c, torch, or triton (on a CPU: Triton's interpreter, for "
                           "tests)", WORKER, choices=("auto", "c", "torch", "triton"))  # fmt: skip
    cuda_graph_max_batch: int = setting(256, "decode steps of up to this many sequences "
                                        "replay CUDA graphs captured per batch-size bucket "
                                        "(CUDA only; 0: off)", WORKER)  # fmt: skip
    quantization: str = setting("none", "int8: the decoder layers' q/k/v, o and gate/up "
                                "products in int8, weights and activations (CPUs; fast with "
                                "VNNI or AMX; perplexity +0.3%, docs/benchmarks.md)", WORKER,
                                choices=("none", "int8"))  # fmt: skip
    kv_store: str = setting("local://", "KV store: local://[PATH], memory://, redis://...",
                            WORKER)  # fmt: skip
    kv_store_dtype: str = setting("auto", "stored blocks' dtype: auto, float32, float16, "
                                  "bfloat16, fp8", WORKER)  # fmt: skip
    kv_store_max_gb: float = setting(8.0, "size cap of a local:// store (least recently used "
                                     "blocks go first)", WORKER)  # fmt: skip
    store_timeout: float = setting(1.0, "seconds per store call before it counts as down",
                                   WORKER)  # fmt: skip
    kv_key_file: str | None = setting(None, "file holding the secret every worker of the "
                                      "deployment shares: stored blocks carry a MAC made with "
                                      "it (none: a checksum only)", WORKER)  # fmt: skip
    num_blocks: int | None = setting(None, "KV blocks in a worker's pool", WORKER, minimum=1)
    kv_cache_gb: float = setting(1.0, "KV pool size when --num-blocks is not given", WORKER)
    max_num_seqs: int = setting(64, "sequences a worker runs at once", WORKER, minimum=1)
    max_num_batched_tokens: int = setting(512, "tokens per engine step", WORKER, minimum=1)
    prefill_chunk_size: int | None = setting(None, "a prompt's tokens per engine step, at most "
                                             "(default: min(256, tokens per step))", WORKER,
                                             minimum=1)  # fmt: skip
    speculative: str = setting("none", "speculative decoding: ngram (prompt lookup), suffix "
                               "(also over recent outputs), draft:MODEL (a smaller model with "
                               "the same tokenizer: .gguf or Hugging Face directory) or none",
                                        WORKER)  # fmt: skip
    num_speculative_tokens: int = setting(4, "tokens proposed per step, at most", WORKER,
                                          minimum=1)  # fmt: skip
    speculative_max_batch: int = setting(4, "running sequences above which nothing is "
                                         "proposed (verifying costs more than it saves)",
                                         WORKER, minimum=0)  # fmt: skip
    grace_period: float = setting(10.0, "seconds in-flight requests get on SIGTERM", WORKER)
    engine_stall_timeout: float = setting(60.0, "seconds without an engine step while requests "
                                          "wait before a worker exits (for a restart)",
                                          WORKER)  # fmt: skip
    write_back: bool = setting(True, "decode: write finished generations' blocks to the store",
                                        WORKER)  # fmt: skip
    metrics_port: int | None = setting(None, "workers: serve Prometheus /metrics and /health "
                                       "over HTTP on this port (up: worker k on this port + "
                                       "k, prefill workers first)", WORKER)  # fmt: skip
    # router
    served_model_name: str | None = setting(None, "the model id clients send", ROUTER)
    prefill: tuple[str, ...] = setting((), "prefill workers, HOST:PORT (router)", ("router",))
    decode: tuple[str, ...] = setting((), "decode workers, HOST:PORT (router)", ("router",))
    policy: str = setting("kv_aware", "routing policy", ROUTER,
                          choices=("round_robin", "least_load", "kv_aware"))  # fmt: skip
    imbalance: int = setting(8, "kv_aware: requests a cached worker may be busier by", ROUTER)
    disagg_threshold: int = setting(0, "prompts with fewer uncached tokens skip prefill (0: off)",
                                    ROUTER)  # fmt: skip
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
    max_body_bytes: int = setting(4 << 20, "largest request body (413 past it)", ROUTER)
    health_interval: float = setting(1.0, "seconds between worker health checks (a worker not "
                                     "healthy is asked every 0.25 s)", ROUTER)  # fmt: skip
    health_timeout: float = setting(5.0, "seconds a worker's health check may take (a busy "
                                    "worker answers late)", ROUTER)  # fmt: skip
    health_failures: int = setting(3, "failed health checks in a row before a worker is left "
                                   "out (one success brings it back)", ROUTER,
                                   minimum=1)  # fmt: skip
    prefill_timeout: float = setting(120.0, "seconds a Prefill may take before another worker "
                                     "is tried", ROUTER)  # fmt: skip
    retry_wait: float = setting(30.0, "seconds a request waits for a worker to come back when "
                                "every one has failed it", ROUTER)  # fmt: skip
    ttft_slo: float = setting(0.0, "seconds a prompt may be expected to wait for its first "
                              "token: past it, computed by a decode worker with room or refused "
                              "(429 + Retry-After); 0: no limit", ROUTER, minimum=0)  # fmt: skip
    # up
    num_prefill: int = setting(1, "prefill workers to start", ("up",), minimum=1)
    num_decode: int = setting(1, "decode workers to start", ("up",), minimum=1)
    colocated: bool | None = setting(None, "no prefill workers: each decode worker computes "
                                     "prompts too, in one engine; unset: chosen by the host's "
                                     "cores (colocated below 8, where the two roles' processes "
                                     "would share cores)", ("up",))  # fmt: skip
    redis: bool = setting(False, "start a redis-server child as the KV store", ("up",))
    redis_max_memory: str = setting("2gb", "--redis: the redis-server's memory cap (least "
                                    "recently used blocks evicted past it)", ("up",))  # fmt: skip

    def port_for(self, role: str) -> int:
        return self.port if self.port is not None else DEFAULT_PORTS[role]

    @classmethod
    def names(cls, role: str | None = None) -> list[str]:
        return [f.name for f in _fields() if role is None or role in f.metadata["roles"]]


@dataclass(frozen=True)
class Loaded:
    settings: Settings
    sources: dict[str, str]  # name -> "default", "file PATH", "env PDSERVE_X" or "flag --x"


def _fields() -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(Settings)


def _kind(name: str) -> type:
    """The value type of a setting: str, int, float, bool or tuple (of str)."""
    hint = typing.get_type_hints(Settings)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = args[0]
    return tuple if typing.get_origin(hint) is tuple else typing.cast(type, hint)


def env_name(name: str) -> str:
    return "PDSERVE_" + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, role: str | None) -> None:
    """A flag per setting of `role` (all settings with None); unset flags leave no value."""
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                        help="TOML settings file (also PDSERVE_CONFIG)")  # fmt: skip
    for f in _fields():
        if role is not None and role not in f.metadata["roles"]:
            continue
        text = f.metadata["help"].replace("%", "%%")  # argparse formats help with %
        kind, help = _kind(f.name), f"{text} [{env_name(f.name)}]"
        common: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help, "dest": f.name}
        if kind is bool:
            parser.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **common)
        elif kind is tuple:
            parser.add_argument(flag_name(f.name), action="append", metavar="VALUE", **common)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag_name(f.name), choices=choices, metavar=None if choices
                                else f.name.upper(), **common)  # fmt: skip


def load(
    role: str,
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
) -> Loaded:
    """The settings `role` runs with: defaults < file < environment < flags."""
    env = os.environ if env is None else env
    given = vars(args) if args is not None else {}
    values: dict[str, Any] = {}
    sources = {f.name: "default" for f in _fields()}
    path = given.get("config") or env.get("PDSERVE_CONFIG")
    if path:
        for name, raw in _read_file(Path(path), role).items():
            values[name] = _convert(name, raw, f"{path}: {name}")
            sources[name] = f"file {path}"
    for f in _fields():
        if env_name(f.name) in env:
            where = env_name(f.name)
            values[f.name] = _convert(f.name, env[where], where)
            sources[f.name] = f"env {where}"
        if f.name in given:
            where = flag_name(f.name)
            raw = given[f.name]
            raw = ",".join(raw) if isinstance(raw, list) else raw
            values[f.name] = _convert(f.name, raw, where)
            sources[f.name] = f"flag {where}"
    return Loaded(Settings(**values), sources)


def _read_file(path: Path, role: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SettingsError(f"{path}: {e}") from e
    known = set(Settings.names())
    merged: dict[str, Any] = {}
    for key, value in data.items():
        if key in ROLES and isinstance(value, dict):
            continue
        merged[key.replace("-", "_")] = value
    if isinstance(data.get(role), dict):
        merged.update({k.replace("-", "_"): v for k, v in data[role].items()})
    unknown = sorted(set(merged) - known)
    if unknown:
        raise SettingsError(f"{path}: unknown settings: {', '.join(unknown)}")
    return merged


def _convert(name: str, raw: Any, where: str) -> Any:
    kind = _kind(name)
    f = next(f for f in _fields() if f.name == name)
    optional = f.default is None
    try:
        if optional and isinstance(raw, str) and raw.strip().lower() in ("", "none"):
            return None
        if kind is tuple:
            items = raw if isinstance(raw, list) else str(raw).split(",")
            return tuple(str(x).strip() for x in items if str(x).strip())
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"not a boolean: {raw!r}")
            return text in ("1", "true", "yes", "on")
        value = kind(raw)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"{where}: {e}") from e
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise SettingsError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    minimum = f.metadata.get("minimum")
    if minimum is not None and value < minimum:
        raise SettingsError(f"{where}: must be at least {minimum}, got {value}")
    return value


def read_secrets(path: str, where: str) -> tuple[str, ...]:
    """The non-empty lines of a secrets file (keys, one per line; `#` starts a comment)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SettingsError(f"{where}: {e}") from e
    found = tuple(x.strip() for x in lines if x.strip() and not x.strip().startswith("#"))
    if not found:
        raise SettingsError(f"{where}: {path} holds no key")
    return found


def child_env(settings: Settings, role: str) -> dict[str, str]:
    """PDSERVE_* variables that give a child process of `role` these settings."""
    out = {}
    for name in Settings.names(role):
        value = getattr(settings, name)
        if value is None:
            continue
        out[env_name(name)] = ",".join(value) if isinstance(value, tuple) else str(value)
    return out


def show(loaded: Loaded, role: str | None) -> str:
    """The settings in effect as a table: name, value, where it came from, its variable."""
    rows = [("setting", "value", "from", "environment")]
    for name in Settings.names(role):
        value = getattr(loaded.settings, name)
        if name == "port":
            value = loaded.settings.port_for(role or "up")
        if name == "kv_store":
            from kvstore.store import redact  # a password in the URL

            value = redact(value)
        if name in SECRETS and value:
            value = "<set>" if isinstance(value, str) else ",".join("<set>" for _ in value)
        elif isinstance(value, tuple):
            value = ",".join(value)
        rows.append((name, str(value), loaded.sources[name], env_name(name)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows
    )


DEFAULTS = Settings()  # the defaults, for the configs built from settings (worker, router)
