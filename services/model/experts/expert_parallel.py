"""Expert parallelism: a MoE model's routed experts spread over N processes (ranks).

Rank 0 is the worker's own process: it runs the engine, attention, the dense layers, the
routers and the shared experts, and holds the KV cache. Ranks 1..N-1 (expert_rank.py, started
and watched by rank 0) hold experts only. Every MoE layer has `slots` expert slots (one per
expert plus `--redundant-experts` spare ones), rank r holding slots [r * P, (r + 1) * P);
eplb.py decides which expert each slot holds. At a MoE layer rank 0 routes, gives each choice
one slot holding a copy of its expert (copies take turns), sends each rank its rows sorted by
slot (dispatch), computes its own meanwhile, and takes the outputs back (combine), a token's
outputs then summed in its own choice order. A row's bits do not depend on which copy, rank or
batch computed it (moe.py), so answers equal one process's token for token.

Why attention stays on rank 0 rather than data parallel across the ranks: one worker is one
engine (one scheduler, one paged cache, one set of block tables); data parallel attention is
pdserve's other axis, more decode workers behind the router. So here the ranks add expert
memory and expert compute, and a step waits once per MoE layer on the slowest rank: what the
balancer evens out.

The wire (torch.distributed point-to-point: gloo on CPUs, NCCL on GPUs): rank 0 sends a header
[command, layer, n] and then the command's tensors; a rank answers RUN with its rows' outputs,
PLACE (a layer's new slots, applied between forward passes, one layer per pass) with the count
of experts it loaded from the checkpoint, STATS with its compute time. A rank that dies closes
its sockets: rank 0's next exchange raises ExpertRankLost and the worker leaves service.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from services.model.errors import ExpertRankLost
from services.model.experts import eplb
from services.model.experts.eplb import copies_of, slot_of
from services.model.layers.layer_ops import LayerOps
from services.model.layers.moe import Moe, run_grouped
from services.model.parallel.group import Group, RankProcesses

log = logging.getLogger("pdserve.experts")
RUN, PLACE, STATS, STOP = 1, 2, 3, 4
TAG = 0


@dataclass
class Balance:
    """Rows per rank at each MoE layer of each pass, summed: max over mean is how much longer
    the layers took than a perfect split would have (1.0: balanced)."""

    busiest: int = 0  # sum over (pass, layer) of the busiest rank's rows
    mean: float = 0.0  # sum over (pass, layer) of the ranks' mean rows

    def add(self, per_rank: list[int]) -> None:
        self.busiest += max(per_rank)
        self.mean += sum(per_rank) / len(per_rank)

    @property
    def imbalance(self) -> float:
        return self.busiest / self.mean if self.mean else 1.0


@dataclass
class Timing:
    """Rank 0's time in MoE dispatch, ns: computing its own rows, and waiting for the others'
    (their compute and the transfers both ways)."""

    local_ns: int = 0
    wait_ns: int = 0
    calls: int = 0


@dataclass
class Rebalancing:
    """The balancer's state: a plan's layers still to apply, the load since the last plan."""

    pending: list[tuple[int, list[int]]] = field(default_factory=list)
    counts_at_plan: dict[int, torch.Tensor] = field(default_factory=dict)
    requested: bool = False
    planned_at: int = 0  # the forward pass the last plan was made at
    plans: int = 0
    experts_loaded: int = 0  # over every rank, since start
    longest_pause_ns: int = 0  # the longest one layer's placement held a pass up
    before: float = 1.0  # the imbalance over the window the last plan was made from


class ExpertGroup:
    """Rank 0's side of the group: dispatch at each MoE layer, the placement, rebalancing."""

    def __init__(
        self,
        layers: dict[int, Moe],
        pg: Group,
        ranks: int,
        slots: int,
        policy: str = "auto",
        nodes: int = 1,
        interval: int = 0,
        device: torch.device | str = "cpu",
        spawned: RankProcesses | None = None,  # the ranks' processes, when this one started them
    ) -> None:
        self.layers, self.pg, self.ranks, self.slots = layers, pg, ranks, slots
        self.device = torch.device(device)
        self.per_rank = slots // ranks
        some = next(iter(layers.values()))
        self.num_experts = some.shape.num_experts
        self.groups = max(some.shape.n_group, 1)
        self.policy = eplb.choose_policy(policy, nodes, self.groups, ranks, slots)
        self.nodes, self.interval = nodes, interval
        self.spawned = spawned
        self.processes = spawned.processes if spawned is not None else []
        self._index = {id(moe): i for i, moe in layers.items()}
        self._first = min(layers)
        self.placement: dict[int, list[int]] = {}
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, moe in layers.items():
            self._set(i, eplb.initial(self.num_experts, slots))
            moe.hold(self.placement[i][: self.per_rank])
            moe.dispatch = self
        self.rank_rows = {i: [0] * ranks for i in layers}  # rows each rank computed, by layer
        self.balance = Balance()  # since the last rebalance
        self.timing = Timing()
        self.passes = 0
        self.rebalancing = Rebalancing(
            counts_at_plan={i: moe.counts.clone() for i, moe in layers.items()}
        )
        self._lock = threading.Lock()  # the side door reads while the engine thread writes

    # -- dispatch and combine ---------------------------------------------------------

    def compute(
        self, moe: Moe, x: torch.Tensor, experts: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        layer = self._index[id(moe)]
        if layer == self._first:
            self._between_passes()
        k = len(experts) // len(x)
        slot = self._slot_of(layer, experts)
        order = slot.argsort(stable=True)  # the choices grouped by slot, so by rank
        per_rank = torch.bincount(slot // self.per_rank, minlength=self.ranks).tolist()
        rows = x.index_select(0, order // k)
        local = slot[order] % self.per_rank
        out = torch.empty_like(rows)
        start = time.perf_counter_ns()
        pending, begin = [], per_rank[0]
        try:
            for r in range(1, self.ranks):
                span = slice(begin, begin + per_rank[r])
                begin = span.stop
                if span.start == span.stop:
                    continue
                pending += self._send(r, RUN, layer, local[span], rows[span])
                pending.append(self.pg.recv([out[span]], r, TAG))
            mine = slice(0, per_rank[0])
            out[mine] = run_grouped(rows[mine], 1, local[mine], moe.slots, ops)
            computed = time.perf_counter_ns()
            for work in pending:
                work.wait()
        except Exception as e:  # the ranks and rank 0 may now be out of step: no more passes
            raise ExpertRankLost(f"{type(e).__name__}: {e}") from e
        with self._lock:
            self.timing.local_ns += computed - start
            self.timing.wait_ns += time.perf_counter_ns() - computed
            self.timing.calls += 1
            self.balance.add(per_rank)
            for r, n in enumerate(per_rank):
                self.rank_rows[layer][r] += n
        per_choice = torch.empty_like(out)
        per_choice[order] = out  # back in (token, choice) order
        return per_choice

    def _slot_of(self, layer: int, experts: torch.Tensor) -> torch.Tensor:
        return slot_of(*self._copies[layer], experts)

    def _set(self, layer: int, slot_experts: list[int]) -> None:
        """A layer's placement and its table of each expert's copies."""
        self.placement[layer] = list(slot_experts)
        self._copies[layer] = copies_of(slot_experts, self.num_experts, self.device)

    def _send(self, rank: int, command: int, layer: int, *tensors: torch.Tensor) -> list:
        n = len(tensors[0]) if tensors else 0
        header = torch.tensor([command, layer, n], dtype=torch.int64, device=self.device)
        return [self.pg.send([t.contiguous()], rank, TAG) for t in (header, *tensors)]

    # -- rebalancing, between forward passes --------------------------------------------

    def request_rebalance(self) -> None:
        """Plan from the load since the last plan, at the next forward pass (any thread)."""
        self.rebalancing.requested = True

    def _between_passes(self) -> None:
        self.passes += 1
        rb = self.rebalancing
        if rb.pending:  # one layer a pass: no pass waits long on moving weights
            self._apply(*rb.pending.pop(0))
            if not rb.pending:
                with self._lock:
                    self.balance = Balance()
            return
        due = self.interval and self.passes - rb.planned_at >= self.interval
        if rb.requested or due:
            rb.requested = False
            self._plan()

    def _plan(self) -> None:
        rb = self.rebalancing
        rb.planned_at, rb.plans = self.passes, rb.plans + 1
        rb.before = self.balance.imbalance
        for i, moe in self.layers.items():
            load = (moe.counts - rb.counts_at_plan[i]).tolist()
            rb.counts_at_plan[i] = moe.counts.clone()
            if not any(load):
                continue
            new = eplb.plan(
                load, self.placement[i], self.ranks, self.policy, self.nodes, self.groups
            )
            if new != self.placement[i]:
                rb.pending.append((i, new))
        log.info(
            "experts planned",
            extra={"fields": {"layers_to_move": len(rb.pending), "imbalance": round(rb.before, 3)}},
        )
        if not rb.pending:
            with self._lock:
                self.balance = Balance()

    def _apply(self, layer: int, slot_experts: list[int]) -> None:
        start, p = time.perf_counter_ns(), self.per_rank
        acks = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.ranks)]
        try:
            pending = []
            for r in range(1, self.ranks):
                share = torch.tensor(slot_experts[r * p : (r + 1) * p], device=self.device)
                pending += self._send(r, PLACE, layer, share)
                pending.append(self.pg.recv([acks[r]], r, TAG))
            acks[0] += self.layers[layer].hold(slot_experts[:p])
            for work in pending:
                work.wait()
        except Exception as e:  # the ranks may hold the new placement, rank 0 the old
            raise ExpertRankLost(f"{type(e).__name__}: {e}") from e
        self._set(layer, slot_experts)
        rb = self.rebalancing
        rb.experts_loaded += int(sum(a.item() for a in acks))
        rb.longest_pause_ns = max(rb.longest_pause_ns, time.perf_counter_ns() - start)

    # -- the rest ---------------------------------------------------------------------

    def rank_stats(self) -> list[tuple[int, int]]:
        """(compute ns, rows) of ranks 1..N-1 since start. Between passes only (the engine
        thread, or with no engine running)."""
        out = []
        for r in range(1, self.ranks):
            reply = torch.zeros(2, dtype=torch.int64, device=self.device)
            for work in self._send(r, STATS, 0):
                work.wait()
            self.pg.recv([reply], r, TAG).wait()
            out.append((int(reply[0]), int(reply[1])))
        return out

    def snapshot(self) -> dict:
        """What the side door shows (any thread)."""
        with self._lock:
            rb = self.rebalancing
            return {
                "ranks": self.ranks, "slots": self.slots, "policy": self.policy,
                "placement": {str(i): p for i, p in self.placement.items()},
                "rank_tokens": {str(i): r for i, r in self.rank_rows.items()},
                "imbalance": self.balance.imbalance, "imbalance_before_rebalance": rb.before,
                "rebalances": rb.plans, "experts_loaded": rb.experts_loaded,
                "longest_pause_ms": rb.longest_pause_ns / 1e6,
            }  # fmt: skip

    def lost(self) -> str | None:
        """Why the group cannot serve: a rank process that exited."""
        return self.spawned.exited() if self.spawned is not None else None

    def stop(self, timeout: float = 10.0, kill: bool = False) -> None:
        """Tell the ranks to exit and wait for them (killed past `timeout`); `kill`: at once
        (the engine thread may be mid-exchange with them)."""
        for r in range(1, self.ranks):
            if kill:
                break
            with contextlib.suppress(RuntimeError):  # gone already
                for work in self._send(r, STOP, 0):
                    work.wait()
        if self.spawned is not None:
            self.spawned.wait(timeout, kill)


def serve(
    pg: Group,
    layers: dict[int, Moe],
    ops: LayerOps,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """A rank's loop: answer rank 0's commands until STOP (RuntimeError if rank 0 is gone)."""

    def ints(*values: int, n: int = 0) -> torch.Tensor:
        if n:
            return torch.empty(n, dtype=torch.int64, device=device)
        return torch.tensor(values, dtype=torch.int64, device=device)

    header = ints(n=3)
    compute_ns = rows_done = 0
    while True:
        pg.recv([header], 0, TAG).wait()
        command, layer, n = header.tolist()
        if command == STOP:
            return
        if command == RUN:
            slots = ints(n=n)
            rows = torch.empty(n, hidden, dtype=dtype, device=device)
            pg.recv([slots], 0, TAG).wait()
            pg.recv([rows], 0, TAG).wait()
            start = time.perf_counter_ns()
            out = run_grouped(rows, 1, slots, layers[layer].slots, ops)
            compute_ns, rows_done = compute_ns + time.perf_counter_ns() - start, rows_done + n
            pg.send([out], 0, TAG).wait()
        elif command == PLACE:
            share = ints(n=n)
            pg.recv([share], 0, TAG).wait()
            pg.send([ints(layers[layer].hold(share.tolist()))], 0, TAG).wait()
        elif command == STATS:
            pg.send([ints(compute_ns, rows_done)], 0, TAG).wait()
