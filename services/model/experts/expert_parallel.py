"""Expert parallelism in the rank-0 layout (`--expert-parallel N`): a MoE model's routed
experts spread over N processes, the worker's own (rank 0) and N - 1 it starts.

Rank 0 runs the engine, attention, the dense layers, the routers and the shared experts, and
holds the KV cache; ranks 1..N-1 (expert_rank.py) hold experts only. This is the
data-parallel layout (services/model/parallel/, docs/parallel.md) with one rank that has
requests: the experts' slots spread over all N, every MoE layer exchanges rows all-to-all
(rank 0 sends every row, so its counts are every rank's load), the balancer plans from the
load and moves experts one layer a pass, and the expert-only ranks run an empty pass for each
of rank 0's. A row's bits do not depend on which copy, rank or batch computed it (moe.py), so
answers equal one process's token for token.

A rank that dies closes its sockets: rank 0's next exchange raises DataRankLost and the worker
leaves service; the watchdog also sees the process exit (`lost`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from services.model.causal_lm import CausalLM
from services.model.errors import DataRankLost, ModelLoadError
from services.model.parallel import data
from services.model.parallel.balancer import Balance, Balancing
from services.model.parallel.group import RankProcesses, RankSpec

log = logging.getLogger("pdserve.experts")


@dataclass(frozen=True)
class Spec(RankSpec):
    """What every rank loads and how the group is laid out."""

    redundant: int = 0
    policy: str = "auto"
    nodes: int = 1
    interval: int = 0  # forward passes between plans (0: only when asked)

    @property
    def balance(self) -> Balancing:
        return Balancing(self.redundant, self.interval, self.policy, self.nodes)

    def args(self) -> list[str]:
        return [
            *super().args(), "--redundant", str(self.redundant), "--policy", self.policy,
            "--nodes", str(self.nodes), "--interval", str(self.interval),
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


class ExpertGroup:
    """Rank 0's side: its votes and exchange with the expert ranks, and their processes."""

    def __init__(self, lockstep: data.Lockstep, spawned: RankProcesses) -> None:
        self.lockstep, self.exchange, self.spawned = lockstep, lockstep.exchange, spawned
        self.processes = spawned.processes
        self.layers = self.exchange.layers

    @property
    def placement(self) -> dict[int, list[int]]:
        return self.exchange.balancer.placement

    @property
    def balance(self) -> Balance:
        """Rows per rank since the last move (a fresh Balance starts a new window)."""
        return self.exchange.balancer.balance

    @balance.setter
    def balance(self, value: Balance) -> None:
        self.exchange.balancer.balance = value

    def request_rebalance(self) -> None:
        """Plan from the load since the last plan, at the next forward pass (any thread)."""
        self.lockstep.request_rebalance()

    def rank_stats(self) -> list[tuple[int, int]]:
        """(compute ns, rows) of every rank since start, as of a vote cast now. Between passes
        only (the engine thread, or with no engine running)."""
        self.lockstep.idle()  # nobody has a pass: a vote, no empty pass
        return [(ns, rows) for rows, ns in self.lockstep.computed]

    def snapshot(self) -> dict[str, Any]:
        """What the side door shows (any thread)."""
        return self.lockstep.spread()

    def lost(self) -> str | None:
        """Why the group cannot serve: a rank process that exited."""
        return self.spawned.exited()

    def stop(self, timeout: float = 10.0, kill: bool = False) -> None:
        """Stop the ranks (a vote that carries rank 0's stop) and wait for them to exit
        (killed past `timeout`); `kill`: at once (the engine thread may be mid-exchange)."""
        if not kill:
            try:
                self.lockstep.finish()
            except DataRankLost:  # one is gone: the rest cannot finish the vote
                kill = True
        self.spawned.wait(timeout, kill)


def start(
    model: CausalLM,
    spec: Spec,
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
    grid = data.Grid(0, spec.ranks, f"127.0.0.1:{spawned.port}", spec.balance)

    def check() -> None:
        why = spawned.exited()
        if why is not None:
            raise ModelLoadError(spec.model, why)

    try:
        lockstep = data.join(model, grid, alone=True, check=check)
    except BaseException:
        spawned.wait(0, kill=True)
        raise
    log.info("experts spread", extra={"fields": {"ranks": spec.ranks, "slots": slots}})
    return ExpertGroup(lockstep, spawned)
