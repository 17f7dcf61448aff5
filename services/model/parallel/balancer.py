"""Which expert each slot of a MoE layer holds, on processes that spread the experts between
them (exchange.py), and the balancer that moves them while they serve.

Every MoE layer has experts + `redundant` slots, process o of the owners holding slots
[o P, (o + 1) P); at start slot s holds expert s % experts (eplb.initial). Every `interval`
passes, or when a vote carries a rank's request (`plan_asked`), every process sums every
process's expert loads since the last plan (one all-reduce), computes the same plan from them
(eplb.plan) and moves one layer a pass: each builds the experts its new slots lack. Every
process keeps the same placement, so each knows where every expert's copies are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from services.model.experts import eplb
from services.model.experts.eplb import copies_of, slot_of
from services.model.layers.moe import Moe
from services.model.parallel.group import Group, lost_on_failure


@dataclass(frozen=True)
class Balancing:
    """The experts' placement over the ranks: spare slots for second copies of hot experts,
    and how often to plan a new placement from the load (eplb.py; 0: never)."""

    redundant: int = 0
    interval: int = 0  # passes between plans
    policy: str = "auto"
    nodes: int = 1


@dataclass
class Balance:
    """Rows per rank at each MoE layer of each pass, as this process sent them, summed: max
    over mean is how much longer the layers took than a perfect split would have (1.0:
    balanced). With the rank-0 layout rank 0 sends every row: every rank's load."""

    busiest: int = 0  # sum over (pass, layer) of the busiest rank's rows
    mean: float = 0.0  # sum over (pass, layer) of the ranks' mean rows

    def add(self, per_rank: list[int]) -> None:
        self.busiest += max(per_rank)
        self.mean += sum(per_rank) / len(per_rank)

    @property
    def imbalance(self) -> float:
        return self.busiest / self.mean if self.mean else 1.0


@dataclass
class Moves:
    """What the balancer has done: its plans, the experts built over every process (each
    builds the experts its new slots hold that its old ones did not), the longest one layer's
    move held a pass up here, and the imbalance of the window the last plan was made from."""

    plans: int = 0
    built: int = 0
    longest_pause_ns: int = 0
    before: float = 1.0
    rank_rows: dict[int, list[int]] = field(default_factory=dict)  # sent to each rank, by layer


class Balancer:
    """One process's copy of the placement (the same on every process) and of the balancer."""

    def __init__(
        self,
        layers: dict[int, Moe],
        ranks: int,
        owner: int,
        owners: int,
        balancing: Balancing,
        pg: Group,
        device: torch.device,
    ) -> None:
        """`ranks`: the data-parallel ranks rows go to; `owner` of `owners`: this process's
        share of the slots (a DP x TP grid has ranks x columns owners); `pg`: the group the
        loads are summed over."""
        self.layers, self.ranks, self.owner, self.owners = layers, ranks, owner, owners
        self.balancing, self.pg, self.device = balancing, pg, device
        some = next(iter(layers.values()))
        self.num_experts = some.shape.num_experts
        self.slots = self.num_experts + balancing.redundant
        if self.slots % owners:
            raise ValueError(f"{self.slots} expert slots do not divide over {owners} processes")
        self.per_rank = self.slots // owners
        self.groups = max(some.shape.n_group, 1)
        self.policy = eplb.choose_policy(
            balancing.policy, balancing.nodes, self.groups, owners, self.slots
        )
        self.placement: dict[int, list[int]] = {}
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.passes = 0  # the same on every rank: each round with a pass runs one on each
        self.pending: list[tuple[int, list[int]]] = []  # a plan's layers still to move
        self.plan_asked = False  # a vote carried a rank's request: plan at the next chance
        self.experts_loaded = 0  # by this process
        self.balance = Balance()  # since the last move
        self.moves = Moves(rank_rows={i: [0] * ranks for i in layers})
        for i in layers:
            self._place(i, eplb.initial(self.num_experts, self.slots))
        self.counts_at_plan = {i: moe.counts.clone() for i, moe in layers.items()}

    def slot_of(self, layer: int, experts: torch.Tensor) -> torch.Tensor:
        """The slot each choice goes to (an expert's copies taking turns)."""
        return slot_of(*self._copies[layer], experts)

    def count(self, layer: int, sent: list[int]) -> None:
        """A pass's rows at a layer, as this process sent them to each rank."""
        self.balance.add(sent)
        per_rank = self.moves.rank_rows[layer]
        for r, n in enumerate(sent):
            per_rank[r] += n

    def between_passes(self) -> None:
        """Before each pass, on every process alike: move a layer, or plan when due."""
        self.passes += 1
        if self.pending:  # one layer a pass: no pass waits long on moving weights
            start = time.perf_counter_ns()
            self._place(*self.pending.pop(0))
            m = self.moves
            m.longest_pause_ns = max(m.longest_pause_ns, time.perf_counter_ns() - start)
            if not self.pending:
                self.balance = Balance()
        elif self.plan_asked or (
            self.balancing.interval and self.passes % self.balancing.interval == 0
        ):
            self.plan_asked = False
            self._plan()

    def _plan(self) -> None:
        """Every process's expert loads since the last plan, summed (one all-reduce),
        planned from: each computes the same plan."""
        order = sorted(self.layers)
        load = torch.stack([self.layers[i].counts - self.counts_at_plan[i] for i in order])
        self.counts_at_plan = {i: self.layers[i].counts.clone() for i in order}
        with lost_on_failure():
            self.pg.allreduce([load]).wait()
        self.moves.plans += 1
        self.moves.before = self.balance.imbalance
        for i, row in zip(order, load.tolist(), strict=True):
            if not any(row):
                continue
            new = eplb.plan(row, self.placement[i], self.owners, self.policy,
                            self.balancing.nodes, self.groups)  # fmt: skip
            if new != self.placement[i]:
                self.pending.append((i, new))
        if not self.pending:
            self.balance = Balance()

    def _place(self, layer: int, slot_experts: list[int]) -> None:
        """A layer's placement: this process holds its slots' experts (built from the
        checkpoint where it held none), every process knows each expert's copies."""
        p = self.per_rank
        self.experts_loaded += self.layers[layer].hold(slot_experts[self.owner * p :][:p])
        old = self.placement.get(layer)
        if old is not None:
            self.moves.built += sum(
                len(set(slot_experts[o * p : (o + 1) * p]) - set(old[o * p : (o + 1) * p]))
                for o in range(self.owners)
            )
        self.placement[layer] = list(slot_experts)
        self._copies[layer] = copies_of(slot_experts, self.num_experts, self.device)

    def spread(self) -> dict[str, Any]:
        """The placement, what it has cost and what it bought, as /experts shows it (any
        thread: values read whole under the GIL)."""
        m = self.moves
        return {
            "ranks": self.ranks, "processes": self.owners, "slots": self.slots,
            "policy": self.policy,
            "placement": {str(i): p for i, p in self.placement.items()},
            "rank_tokens": {str(i): list(r) for i, r in m.rank_rows.items()},
            "imbalance": self.balance.imbalance, "imbalance_before_rebalance": m.before,
            "rebalances": m.plans, "experts_loaded": m.built,
            "longest_pause_ms": m.longest_pause_ns / 1e6,
        }  # fmt: skip
