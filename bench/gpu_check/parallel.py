"""Section 7: the ranks' exchanges over the device's own collectives (docs/parallel.md).

A tiny Qwen3-MoE made by the transformers in use (tests/support/tiny_models.py, under
DIR/parallel, removed after), float32, greedy, its prompts in one batch:

- tensor parallelism over 2 ranks (services/model/parallel/ranks.py: the heads and the
  experts split, NCCL between GPU 0 and GPU 1; gloo on a CPU);
- data parallelism over 2 ranks (parallel/data.py: each rank half the prompts and half the
  experts, the rows exchanged all-to-all), the ranks as processes.

Pass: every rank's tokens equal one process's for the same prompts. Skip: a machine with one
GPU (the NCCL path needs two); the CPU suite's dry run takes gloo through the same code.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
from typing import Any

import torch

from bench.gpu_check.check import Check, Skip
from bench.gpu_check.families import engine_tokens, prompts
from bench.offline import log
from services.launcher import free_port
from services.model.loader import load_model
from services.model.loading.sources import EMBEDDED, resolve
from services.model.parallel import data, ranks


def run(check: Check, numbers: dict[str, Any]) -> bool:
    from tests.support import tiny_models as tiny

    gpus = torch.cuda.device_count() if check.device.type == "cuda" else 0
    if check.device.type == "cuda" and gpus < 2:
        raise Skip(f"{gpus} GPU: the NCCL path needs 2 (run where a machine has 2 or more)")
    path, tokens = check.out / "parallel", 8 if check.dry else 24
    batch = prompts(tiny.VOCAB)
    try:
        tiny.save_tiny("qwen3_moe", path, resolve(EMBEDDED))
        one = load_model(str(path), "float32", str(check.device))
        expected, _ = engine_tokens(one, batch, tokens)
        halves = [batch[::2], batch[1::2]]
        expected_halves = [engine_tokens(one, half, tokens)[0] for half in halves]
        del one
        log("  tensor parallel 2")
        mine = load_model(str(path), "float32", str(check.device), tensor=(0, 2))
        spec = ranks.Spec(str(path), "float32", str(check.device), "auto", 2)
        split = ranks.start(mine.model, spec)
        try:
            got, _ = engine_tokens(dataclasses.replace(mine, model=split), batch, tokens)
        finally:
            split.leader.stop()
        numbers["tensor_parallel_equal"] = got == expected
        log("  data parallel 2")
        got_halves = _data_parallel(str(path), str(check.device), halves, tokens)
        numbers["data_parallel_equal"] = got_halves == expected_halves
        numbers["backend"] = "nccl" if check.device.type == "cuda" else "gloo"
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return bool(numbers["tensor_parallel_equal"] and numbers["data_parallel_equal"])


def _rank(path: str, device: str, rank: int, port: int, batch, tokens: int, out) -> None:
    try:
        where = str(torch.device(device, rank)) if device == "cuda" else device
        loaded = load_model(path, "float32", where)
        lockstep = data.join(loaded.model, data.Grid(rank, 2, f"127.0.0.1:{port}"))
        engine = _InStep(loaded, lockstep)
        got = engine.tokens(batch, tokens)
        while lockstep.idle():  # the other rank's passes, until neither has one
            pass
        lockstep.leave()
        out.put((rank, got))
    except Exception as e:
        out.put((rank, f"{type(e).__name__}: {e}"))
    # results delivered: end without the interpreter's teardown, in which a process holding
    # groups made directly can abort (data.Lockstep.leave)
    out.close()
    out.join_thread()
    os._exit(0)


class _InStep:
    """The engine stepped by hand, each step one round of the ranks' votes."""

    def __init__(self, loaded: Any, lockstep: data.Lockstep) -> None:
        from services.engine.engine import Engine, EngineConfig

        self.engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
        self.lockstep = lockstep

    def tokens(self, batch: list[list[int]], tokens: int) -> list[list[int]]:
        from services.engine.params import SamplingParams
        from services.engine.request import EngineRequest

        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(batch):
            self.engine.add_request(EngineRequest(f"p{i}", prompt, params))
        got: dict[str, list[int]] = {f"p{i}": [] for i in range(len(batch))}
        while self.engine.has_unfinished:
            for d in self.engine.step():
                got[d.request_id] += d.token_ids
            self.lockstep.round_done()
        return [got[f"p{i}"] for i in range(len(batch))]


def _data_parallel(path: str, device: str, halves, tokens: int) -> list:
    spawn = multiprocessing.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [
        spawn.Process(target=_rank, args=(path, device, r, port, halves[r], tokens, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return [got[r] for r in range(2)]


def summary(n: dict[str, Any]) -> str:
    return (
        f"{n['backend']}: tensor parallel 2 equal {n['tensor_parallel_equal']}, "
        f"data parallel 2 equal {n['data_parallel_equal']}"
    )
