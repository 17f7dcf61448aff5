"""Section 3: decode tokens/s and one prompt's prefill, the engine against transformers."""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import torch

from bench.gpu_check.check import BLOCK, Check
from bench.offline import log, workload
from services.engine.engine import Engine, EngineConfig, StepTimes
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.model.loader import LoadedModel, resolve_dtype
from services.settings import DEFAULTS


class Decode(NamedTuple):
    tok_s: float
    graph_replays: int | None  # CUDA graph replays in the timed steps; None: the engine has none


def engine_decode(
    check: Check, loaded: LoadedModel, batch: int, keep: list[Engine] | None = None, **config: Any
) -> Decode:
    """Decode tokens/s with `batch` sequences all decoding (prefill and warm steps untimed);
    `keep` gets the engine (its `times`: the timed steps')."""
    sizes = check.sizes
    tokens = sizes.warm_steps + sizes.decode_steps + 2
    blocks = batch * math.ceil((sizes.decode_prompt_len + tokens) / BLOCK) + 8
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(num_blocks=blocks, max_num_seqs=batch, **config),
    )
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    length = sizes.decode_prompt_len
    for i, p in enumerate(workload(batch, length, length, seed=batch)):
        engine.add_request(EngineRequest(f"d{i}", p, params))
    while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    for _ in range(sizes.warm_steps):
        engine.step()
    assert len(engine.scheduler.running) == batch, "not every sequence is decoding"
    replays = engine.runner.graphs.replays if engine.runner.graphs else 0
    engine.times = StepTimes()
    if keep is not None:
        keep.append(engine)
    check.sync()
    start = time.perf_counter()
    for _ in range(sizes.decode_steps):
        engine.step()
    check.sync()
    seconds = time.perf_counter() - start
    replayed = engine.runner.graphs.replays - replays if engine.runner.graphs else None
    return Decode(batch * sizes.decode_steps / seconds, replayed)


def engine_prefill(check: Check, loaded: LoadedModel) -> float:
    """Seconds of one fresh prompt's prefill, in one chunk, after one untimed prefill."""
    n = check.sizes.prefill_len
    config = EngineConfig(
        num_blocks=2 * math.ceil(n / BLOCK) + 8,
        max_num_batched_tokens=n,
        prefill_chunk_size=n,
        enable_prefix_caching=False,
    )
    engine = Engine(loaded.model, loaded.tokenizer, config)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    seconds = 0.0
    for i, prompt in enumerate(workload(2, n, n, seed=7)):
        engine.add_request(EngineRequest(f"p{i}", prompt, params))
        check.sync()
        start = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        check.sync()
        seconds = time.perf_counter() - start
    return seconds


def hf_generate_seconds(check: Check, hf: Any, ids: torch.Tensor, tokens: int) -> float:
    check.sync()
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
    check.sync()
    return time.perf_counter() - start


def hf_decode(check: Check, hf: Any, batch: int) -> float:
    """transformers' decode tokens/s: time(steps + 1 tokens) - time(1 token)."""
    steps, length = check.sizes.decode_steps, check.sizes.decode_prompt_len
    ids = torch.tensor(workload(batch, length, length, seed=batch), device=check.device)
    hf_generate_seconds(check, hf, ids, 2)  # warm
    first = hf_generate_seconds(check, hf, ids, 1)
    return batch * steps / (hf_generate_seconds(check, hf, ids, steps + 1) - first)


def engine_row(
    check: Check, loaded: LoadedModel, kernels: str, batch: int, **config: Any
) -> dict[str, Any]:
    """One row of the decode table: the engine's."""
    d = engine_decode(check, loaded, batch, **config)
    return {"system": "pdserve", "kernels": kernels, "batch": batch, "tok_s": d.tok_s,
            "graph_replays": d.graph_replays, "steps": check.sizes.decode_steps,
            "async": config.get("async_scheduling", "auto"),
            "deterministic": getattr(loaded.model, "deterministic", True)}  # fmt: skip


def run(check: Check, numbers: dict[str, Any]) -> bool:
    dtype = str(resolve_dtype("auto", check.device)).removeprefix("torch.")
    loaded, sizes = check.model(dtype), check.sizes
    rows: list[dict[str, Any]] = []
    numbers |= {"dtype": dtype, "decode": rows}
    for b in sizes.decode_batches:
        for overlap in ("off", "on"):  # async scheduling (services/engine/inflight.py)
            log(f"  the engine: decode at batch {b}, async scheduling {overlap}")
            rows.append(engine_row(check, loaded, "auto", b, async_scheduling=overlap))
    if check.device.type == "cuda":
        for b in (1, 32):
            log(f"  the engine: decode at batch {b}, no CUDA graphs")
            rows.append(engine_row(check, loaded, "auto", b, cuda_graph_max_batch=0))
    cublas = check.model(dtype, deterministic=False)  # products by cuBLAS (a CPU: no change)
    for b in sizes.decode_batches:
        log(f"  the engine: decode at batch {b}, deterministic off")
        rows.append(engine_row(check, cublas, "auto", b, async_scheduling="on"))
    log(f"  prefill of {sizes.prefill_len} tokens, deterministic off")
    cublas_prefill = engine_prefill(check, cublas)
    del check.models[dtype, DEFAULTS.model.kernels, False]
    hf = check.reference(dtype)
    for b in sizes.hf_batches:
        log(f"  transformers: decode at batch {b}")
        rows.append({"system": "transformers", "batch": b, "tok_s": hf_decode(check, hf, b)})
    log(f"  prefill of {sizes.prefill_len} tokens: the engine, transformers")
    mine = engine_prefill(check, loaded)
    ids = torch.tensor(
        workload(1, sizes.prefill_len, sizes.prefill_len, seed=8), device=check.device
    )
    hf_generate_seconds(check, hf, ids, 1)  # warm
    theirs = hf_generate_seconds(check, hf, ids, 1)
    numbers["prefill"] = {"tokens": sizes.prefill_len, "pdserve_s": mine,
                          "pdserve_not_deterministic_s": cublas_prefill,
                          "transformers_s": theirs, "ratio": theirs / mine}  # fmt: skip
    if check.device.type == "cuda" and check.left() > 120:
        torch_kernels(check, dtype, rows)
    base = {r["batch"]: r["tok_s"] for r in rows if r["system"] == "transformers"}
    for r in rows:
        if r["system"] == "pdserve" and r["batch"] in base:
            r["vs_transformers"] = r["tok_s"] / base[r["batch"]]
    return True


def torch_kernels(check: Check, dtype: str, rows: list[dict[str, Any]]) -> None:
    """The torch reference kernels' decode, for comparison with the Triton ones (no CUDA
    graphs: the engine captures Triton's only)."""
    loaded = check.model(dtype, "torch")
    for b in (1, 32):
        log(f"  the engine, kernels torch: decode at batch {b}")
        rows.append(engine_row(check, loaded, "torch", b))
    del check.models[dtype, "torch", True]


def summary(n: dict[str, Any]) -> str:
    p = n["prefill"]
    return (
        f"{n['dtype']}; prefill {p['tokens']} tokens {1000 * p['pdserve_s']:.0f} ms "
        f"(deterministic off {1000 * p['pdserve_not_deterministic_s']:.0f} ms; "
        f"transformers {1000 * p['transformers_s']:.0f} ms, {p['ratio']:.2f}x); "
        "decode below"
    )


def decode_table(rows: list[dict[str, Any]]) -> list[str]:
    """The decode rows as a markdown table; CUDA graphs: replays / timed steps, or off."""
    lines = [
        "| system | kernels | CUDA graphs | async | deterministic | batch | decode tok/s "
        "| vs transformers |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        graphs = ""
        if r["system"] == "pdserve":
            replays = r["graph_replays"]
            graphs = "off" if replays is None else f"{replays}/{r['steps']} steps replayed"
        ratio = f"{r['vs_transformers']:.2f}x" if "vs_transformers" in r else ""
        lines.append(
            f"| {r['system']} | {r.get('kernels', '')} | {graphs} | "
            f"{r.get('async', '')} | {r.get('deterministic', '')} | {r['batch']} | "
            f"{r['tok_s']:.1f} | {ratio} |"
        )
    return lines
