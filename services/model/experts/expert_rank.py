"""The expert ranks' processes: rank 0 (a worker) starts ranks 1..N-1 with `start`, each runs
`main` (python -m services.model.experts.expert_rank): it loads the model through the same code as
rank 0, so that its experts compute the same bits, keeps its slots' experts, joins the group
and answers rank 0 until told to stop or until rank 0 is gone."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import torch

from services.model.causal_lm import CausalLM
from services.model.errors import ModelLoadError
from services.model.experts import eplb
from services.model.experts.expert_parallel import ExpertGroup, serve
from services.model.parallel.group import RankProcesses, connect

log = logging.getLogger("pdserve.experts")


@dataclass(frozen=True)
class Spec:
    """What every rank loads and how the group is laid out."""

    model: str
    dtype: str
    device: str
    kernels: str
    ranks: int
    redundant: int = 0

    def args(self) -> list[str]:
        return [
            "--model", self.model, "--dtype", self.dtype, "--device", self.device,
            "--kernels", self.kernels, "--ranks", str(self.ranks),
            "--redundant", str(self.redundant),
        ]  # fmt: skip


def slots_of(model: CausalLM, spec: Spec) -> int:
    """Slots per MoE layer; ModelLoadError where the model cannot be spread so."""
    moe = model.config.moe
    if moe is None or not model.moe_layers():
        raise ModelLoadError(model.config.name, "--expert-parallel needs a mixture of experts")
    slots = moe.num_experts + spec.redundant
    if slots % spec.ranks:
        raise ModelLoadError(
            model.config.name,
            f"{moe.num_experts} experts + {spec.redundant} redundant slots do not divide "
            f"over --expert-parallel {spec.ranks}",
        )
    return slots


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A GPU each (cuda:i + rank); one CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def start(
    model: CausalLM,
    spec: Spec,
    policy: str = "auto",
    nodes: int = 1,
    interval: int = 0,
    timeout: float = 3600.0,
) -> ExpertGroup:
    """Start ranks 1..N-1 and the group around `model` (rank 0's, loaded from spec.model)."""
    slots = slots_of(model, spec)
    gpus_needed = (model.device.index or 0) + spec.ranks
    if model.device.type == "cuda" and torch.cuda.device_count() < gpus_needed:
        raise ModelLoadError(spec.model, f"--expert-parallel {spec.ranks} needs a GPU per rank")
    threads = max(1, (os.cpu_count() or 1) // spec.ranks)
    spawned = RankProcesses("services.model.experts.expert_rank", spec.args(), spec.ranks,
                            threads, "expert")  # fmt: skip
    pg = spawned.join(spec.model, spec.ranks, model.device, timeout)
    group = ExpertGroup(model.moe_layers(), pg, spec.ranks, slots, policy, nodes, interval,
                        model.device, spawned)  # fmt: skip
    log.info("experts spread", extra={"fields": {"ranks": spec.ranks, "slots": slots}})
    return group


def exit_with_parent() -> None:
    """Exit as soon as rank 0's process is gone, whatever this one is doing (loading, joining,
    serving): a rank alone serves nothing."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    from services import logs
    from services.model.loader import load_model, resolve_device

    p = argparse.ArgumentParser(description=__doc__)
    for name in ("model", "dtype", "device", "kernels"):
        p.add_argument(f"--{name}", required=True)
    for name in ("ranks", "redundant", "rank", "port", "threads"):
        p.add_argument(f"--{name}", type=int, required=True)
    a = p.parse_args(argv)
    logs.configure()
    exit_with_parent()
    torch.set_num_threads(a.threads)
    spec = Spec(a.model, a.dtype, a.device, a.kernels, a.ranks, a.redundant)
    device = rank_device(resolve_device(a.device), a.rank)
    model = load_model(a.model, a.dtype, str(device), kernels=a.kernels).model
    slots = slots_of(model, spec)
    per_rank = slots // a.ranks
    layers = model.moe_layers()
    for moe in layers.values():
        mine = eplb.initial(moe.shape.num_experts, slots)[a.rank * per_rank :][:per_rank]
        moe.hold(mine)
    ops, hidden, dtype = cast(Any, model).ops, model.config.hidden_size, model.dtype
    # a rank computes experts only: the rest of the model goes (the experts' build closures
    # keep the model object, not what it holds)
    for name in ("layers", "embed", "lm_head", "norm", "attention", "mla"):
        if hasattr(model, name):
            setattr(model, name, None)
    del model
    try:
        pg = connect("127.0.0.1", a.port, a.rank, a.ranks, device)
        serve(pg, layers, ops, hidden, dtype, device)
    except RuntimeError as e:  # rank 0 is gone: nothing to serve
        why = {"rank": a.rank, "why": str(e)[:200]}
        log.warning("expert rank: rank 0 gone", extra={"fields": why})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
