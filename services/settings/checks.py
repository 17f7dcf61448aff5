"""Settings checked once, before anything starts: what each role would otherwise find wrong
only after minutes of loading (a key file, a store directory, the model's architecture).

`check` returns the settings as the role runs with them: secret files read into the values
they add to (API keys, the admin key), so nothing reads them again.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from services.settings.loading import read_secrets, replace
from services.settings.sections import ROUTER, WORKER, Settings, SettingsError

MEMORY = re.compile(r"\d+(b|k|kb|m|mb|g|gb)?", re.IGNORECASE)  # redis.conf's memory units


def check(settings: Settings) -> Settings:
    """`settings` ready for their role, or SettingsError / ModelLoadError naming the problem."""
    role = settings.role
    _trace_file(settings)
    if role in ROUTER:
        settings = _router_secrets(settings)
    if role in (*WORKER, "encode"):
        _store(settings)
    if role in WORKER and settings.engine.speculative.method == "draft":
        if settings.engine.speculative.draft_model is None:  # the worker loads it
            raise SettingsError(settings.engine.speculative.malformed)
        check_model(settings.engine.speculative.draft_model)
    if role == "up":
        _up(settings)
    path = check_model(settings.model.model)
    if role == "encode" or (role == "up" and settings.up.num_encode):
        _reads_images(path)
    if role in WORKER and settings.experts.expert_parallel > 1:
        _experts(settings, path)
    if role in WORKER and settings.model.tensor_parallel > 1:
        _tensor(settings, path)
    if role in (*WORKER, "up") and settings.worker.data_parallel > 1:
        _data(settings, path, given_by_up=role == "up")
    if role in WORKER and settings.engine.speculative.method == "mtp":
        from services.model.errors import ModelLoadError
        from services.model.loading.hf_config import read_config
        from services.model.loading.hf_dir import check_mtp

        try:
            check_mtp(path, read_config(path))
        except ModelLoadError as e:
            raise SettingsError(
                f"speculative: mtp: {path} has no MTP layer "
                f"(num_nextn_predict_layers) of a DeepSeek-V3 or V4: "
                f"{e.problem}"
            ) from None
    return settings


def check_model(spec: str) -> Path:
    """The model's Hugging Face directory, its config read: an architecture or a field the
    engine does not serve is refused here (ModelLoadError). A GGUF is converted, once."""
    from services.model.loading import hf_config, sources

    path = sources.resolve(spec)
    hf_config.read_config(path)
    return path


def _experts(s: Settings, path: Path) -> None:
    """--expert-parallel: a MoE model whose slots divide over the ranks, a policy that fits."""
    from services.model.experts import eplb
    from services.model.loading import hf_config

    es, moe = s.experts, hf_config.read_config(path).moe
    if moe is None:
        raise SettingsError(f"expert_parallel: {path} is not a mixture-of-experts model")
    slots = moe.num_experts + es.redundant_experts
    if slots % es.expert_parallel:
        raise SettingsError(
            f"expert_parallel: {moe.num_experts} experts + {es.redundant_experts} redundant "
            f"slots do not divide over {es.expert_parallel} ranks"
        )
    try:
        eplb.choose_policy(
            es.eplb_policy, es.eplb_nodes, max(moe.n_group, 1), es.expert_parallel, slots
        )
    except ValueError as e:
        raise SettingsError(f"eplb_policy: {e}") from e


def _tensor(s: Settings, path: Path) -> None:
    """--tensor-parallel: a model that splits exactly, beside nothing it cannot run with."""
    from services.model.loading import hf_config
    from services.model.parallel import plan

    size = s.model.tensor_parallel
    beside = {
        "expert_parallel": s.experts.expert_parallel > 1,
        "quantization": s.model.quantization != "none",
        "speculative": s.engine.speculative.method == "mtp",
    }
    for name, taken in beside.items():
        if taken:
            raise SettingsError(f"tensor_parallel: not yet with --{name.replace('_', '-')}")
    try:
        plan.check(hf_config.read_config(path), size)
    except ValueError as e:
        raise SettingsError(f"tensor_parallel: {e}") from None


def _data(s: Settings, path: Path, given_by_up: bool) -> None:
    """--data-parallel: a MoE model's experts divide over the ranks (a dense model's ranks are
    replicas: nothing to divide), this rank is among them, they meet at an address
    (`given_by_up`: up gives each worker these two)."""
    from services.model.loading import hf_config

    w, moe = s.worker, hf_config.read_config(path).moe
    slots = moe.num_experts + s.experts.redundant_experts if moe and moe.layers else 0
    if slots % w.data_parallel:
        raise SettingsError(
            f"data_parallel: {slots - s.experts.redundant_experts} experts + "
            f"{s.experts.redundant_experts} "
            f"redundant slots do not divide over {w.data_parallel} ranks"
        )
    if not given_by_up and w.data_parallel_rank >= w.data_parallel:
        raise SettingsError(
            f"data_parallel_rank: {w.data_parallel_rank} is not below --data-parallel "
            f"{w.data_parallel}"
        )
    address = w.data_parallel_address  # none on rank 0: it starts the others (siblings.py)
    needed = address or (w.data_parallel_rank and not given_by_up)
    if needed and not re.fullmatch(r".+:\d+", address):
        raise SettingsError(f"data_parallel_address: {address!r} is not host:port")
    if s.experts.expert_parallel > 1:  # expert-only ranks beside ranks with requests
        raise SettingsError("data_parallel: not yet with --expert-parallel")


def _trace_file(s: Settings) -> None:
    if s.server.trace_file is None:
        return
    try:
        with open(s.server.trace_file, "a"):
            pass
    except OSError as e:
        raise SettingsError(f"trace_file: cannot append to {s.server.trace_file}: {e}") from e


def _router_secrets(s: Settings) -> Settings:
    r = s.router
    api_keys, admin_key = r.api_keys, r.admin_key
    if r.api_keys_file:
        api_keys += read_secrets(r.api_keys_file, "--api-keys-file")
    if r.admin_key_file:
        admin_key = read_secrets(r.admin_key_file, "--admin-key-file")[0]
    return replace(s, api_keys=api_keys, admin_key=admin_key)


def _store(s: Settings) -> None:
    """The key file and a local:// store's directory, usable."""
    from kvstore.keyfile import read_key
    from kvstore.local import path_of, private_dir

    try:
        if s.store.kv_key_file:
            read_key(s.store.kv_key_file)
        bare = s.role == "up" and s.store.kv_store == "local://"  # up makes its own
        if s.store.kv_store.startswith("local:") and not bare:
            private_dir(path_of(s.store.kv_store))
    except (OSError, ValueError) as e:
        raise SettingsError(str(e)) from e


def _reads_images(path: Path) -> None:
    """An encode worker needs a model that reads images."""
    from services.model.loading.hf_config import read_config

    if read_config(path).vision is None:
        raise SettingsError(f"encode: {path.name} reads no images (an encode worker runs a "
                            "model's vision tower)")  # fmt: skip


def _up(s: Settings) -> None:
    if s.up.redis:
        if shutil.which("redis-server") is None:
            raise SettingsError(
                "--redis: redis-server is not installed (apt-get install redis-server); "
                "or give --kv-store redis://HOST:PORT"
            )
        if not MEMORY.fullmatch(s.up.redis_max_memory):
            raise SettingsError(
                f"redis_max_memory: {s.up.redis_max_memory!r} is not a size like 512mb or 2gb"
            )
