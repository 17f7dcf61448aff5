"""The experts' all-to-all among data-parallel ranks (data.py): one process's side of it, a
Dispatch for its MoE layers, and the balancer that moves experts between the ranks.

At a MoE layer each rank routes its own tokens, gives each choice a slot holding a copy of its
expert (copies take turns: eplb.py), and sends every rank the rows bound for its slots
(dispatch); each rank computes the rows it received, from every rank, grouped by its slots,
and sends them back (combine). A row's bits do not depend on which copy, rank or batch
computed it (moe.py), so each rank's answers equal one process's.

The balancer: every `interval` passes, or when a vote carries a rank's request, every rank
sums every rank's expert loads since the last plan (one all-reduce), computes the same plan
from them and moves its experts one layer a pass. What the placement costs and buys is kept
as `/experts`' `parallel` shows it (`spread`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from services.model.errors import DataRankLost
from services.model.experts import eplb
from services.model.experts.eplb import copies_of, slot_of
from services.model.layers.layer_ops import LayerOps
from services.model.layers.moe import Moe, run_grouped
from services.model.parallel.group import Group
from services.model.parallel.tensor import TensorGroup

INT64 = torch.int64


class Voter(Protocol):
    """The ranks' agreement (data.Lockstep), as a pass's first MoE layer casts its vote."""

    def passing(self) -> None: ...


@dataclass(frozen=True)
class Balancing:
    """The experts' placement over the ranks: spare slots for second copies of hot experts,
    and how often to plan a new placement from the load (eplb.py; 0: never)."""

    redundant: int = 0
    interval: int = 0  # passes between plans
    policy: str = "auto"
    nodes: int = 1


@dataclass
class LockstepTiming:
    """Where the ranks' agreement costs time, ns: the votes (waiting for the others included),
    the empty passes, and the exchanges inside real passes; and the bytes this rank's
    exchanges sent to the other ranks (rows, their slots and counts; none to itself)."""

    votes: int = 0
    vote_ns: int = 0
    empty_passes: int = 0
    empty_ns: int = 0
    exchanges: int = 0
    exchange_ns: int = 0
    sent_bytes: int = 0
    compute_ns: int = 0  # this process's experts computing the rows it received
    computed_rows: int = 0


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


class ExpertExchange:
    """One process's side of the all-to-all: a Dispatch for its MoE layers.

    With tensor ranks inside each data-parallel rank (`tp`: a DP x TP grid), the experts'
    slots spread over all N x M processes, process (d, j) holding the (d M + j)-th share.
    Every tensor rank of a DP rank has the same rows and routes them alike; tensor rank j
    takes the choices bound for column j's slots and exchanges them all-to-all with the
    j-th tensor ranks of the other DP ranks (`pg`: that column's group); the tensor ranks
    then all-gather their columns' outputs. Without tensor ranks, one column: the exchange
    above."""

    def __init__(
        self,
        layers: dict[int, Moe],
        pg: Group,
        rank: int,
        ranks: int,
        ops: LayerOps,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        balance: Balancing | None = None,
        tp: TensorGroup | None = None,
    ) -> None:
        self.layers, self.pg, self.rank, self.ranks = layers, pg, rank, ranks
        self.ops, self.hidden, self.dtype, self.device = ops, hidden, dtype, device
        self.tp = tp
        self.columns, self.column = (tp.size, tp.rank) if tp is not None else (1, 0)
        some = next(iter(layers.values()))
        self.num_experts = some.shape.num_experts
        self.balancing = balance or Balancing()
        self.slots = self.num_experts + self.balancing.redundant
        owners = ranks * self.columns
        if self.slots % owners:
            raise ValueError(f"{self.slots} expert slots do not divide over {owners} processes")
        self.per_rank = self.slots // owners
        self.owner = rank * self.columns + self.column  # this process's share of the slots
        self.policy = eplb.choose_policy(
            self.balancing.policy, self.balancing.nodes, max(some.shape.n_group, 1), owners,
            self.slots,
        )  # fmt: skip
        self._index = {id(moe): i for i, moe in layers.items()}
        self._first = min(layers)
        self.placement: dict[int, list[int]] = {}
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.passes = 0  # the same on every rank: each round with a pass runs one on each
        self.pending: list[tuple[int, list[int]]] = []  # a plan's layers still to move
        self.plan_asked = False  # a vote carried a rank's request: plan at the next chance
        self.experts_loaded = 0  # by this process
        self.timing = LockstepTiming()
        self.balance = Balance()  # since the last move
        self.moves = Moves(rank_rows={i: [0] * ranks for i in layers})
        for i, moe in layers.items():
            moe.dispatch = self
            self._place(i, eplb.initial(self.num_experts, self.slots))
        self.counts_at_plan = {i: moe.counts.clone() for i, moe in layers.items()}
        self.lockstep: Voter | None = None  # casts a pass's vote at its first MoE layer

    def compute(
        self, moe: Moe, x: torch.Tensor, experts: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        layer = self._index[id(moe)]
        if layer == self._first:
            if self.lockstep is not None:
                self.lockstep.passing()
            self._between_passes()
        return self._exchange(layer, moe, x, experts, ops)

    def _exchange(
        self, layer: int, moe: Moe, x: torch.Tensor, experts: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        start = time.perf_counter_ns()
        k = len(experts) // len(x) if len(x) else 1
        slot = slot_of(*self._copies[layer], experts)
        owner = slot // self.per_rank
        columns = [torch.nonzero(owner % self.columns == c).flatten() for c in range(self.columns)]
        mine = columns[self.column]  # the choices this column computes
        order = slot[mine].argsort(stable=True)  # by slot, so by DP rank
        picked = mine[order]
        sent = torch.bincount(owner[picked] // self.columns, minlength=self.ranks)
        got = self._all_to_all(sent, [1] * self.ranks, [1] * self.ranks)
        sent_n, got_n = sent.tolist(), got.tolist()
        if len(experts):  # a pass of this rank's own
            self.balance.add(sent_n)
            per_rank = self.moves.rank_rows[layer]
            for r, n in enumerate(sent_n):
                per_rank[r] += n
        # this rank's own choices stay here, computed while the others' rows travel
        lo, n = sum(sent_n[: self.rank]), sent_n[self.rank]
        own, away = picked[lo : lo + n], torch.cat([picked[:lo], picked[lo + n :]])
        out_of, into = list(sent_n), list(got_n)
        out_of[self.rank] = into[self.rank] = 0
        # each row with the slot it goes to on its rank: one message, not two
        wire = with_slots(x.index_select(0, away // k), slot[away] % self.per_rank)
        arriving = self._start_all_to_all(wire, into, out_of)
        computed = self._compute(x.index_select(0, own // k), slot[own] % self.per_rank, moe, ops)
        rows, local = without_slots(arriving(), x.dtype)
        theirs = self._compute(rows, local, moe, ops)
        back = self._all_to_all(theirs, out_of, into)  # computed where they went
        per_choice = back.new_empty(len(experts), self.hidden)
        per_choice[away] = back  # in (token, choice) order
        per_choice[own] = computed
        if self.tp is not None:  # every column's, from its tensor rank
            self._gather_columns(per_choice, columns)
        self.timing.exchanges += 1
        self.timing.exchange_ns += time.perf_counter_ns() - start
        return per_choice

    def _gather_columns(self, per_choice: torch.Tensor, columns: list[torch.Tensor]) -> None:
        """Fill in the other columns' choices from their tensor ranks (all-gathered: every
        tensor rank knows each column's choices, having routed the same rows)."""
        assert self.tp is not None
        counts = [len(c) for c in columns]
        widest = max(counts)
        if widest == 0:
            return
        mine = per_choice[columns[self.column]]
        padded = torch.cat([mine, mine.new_zeros(widest - len(mine), self.hidden)])
        parts = self.tp.gather(padded, dim=0).split(widest)
        for c, (part, n) in enumerate(zip(parts, counts, strict=True)):
            if c != self.column:
                per_choice[columns[c]] = part[:n]

    def empty_pass(self) -> None:
        """Every MoE layer's exchange, in order, with no rows of this rank's own."""
        rows = torch.empty(0, self.hidden, dtype=self.dtype, device=self.device)
        none = torch.empty(0, dtype=INT64, device=self.device)
        self._between_passes()
        for i in sorted(self.layers):
            self._exchange(i, self.layers[i], rows, none, self.ops)

    # -- the balancer: every rank plans the same placement from the summed loads -------

    def _between_passes(self) -> None:
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
        """Every rank's expert loads since the last plan, summed (one all-reduce), planned
        from: each rank computes the same plan."""
        order = sorted(self.layers)
        load = torch.stack([self.layers[i].counts - self.counts_at_plan[i] for i in order])
        self.counts_at_plan = {i: self.layers[i].counts.clone() for i in order}
        with lost_on_failure():
            self.pg.allreduce([load]).wait()
        self.moves.plans += 1
        self.moves.before = self.balance.imbalance
        groups = max(self.layers[order[0]].shape.n_group, 1)
        for i, row in zip(order, load.tolist(), strict=True):
            if not any(row):
                continue
            new = eplb.plan(row, self.placement[i], self.ranks * self.columns, self.policy,
                            self.balancing.nodes, groups)  # fmt: skip
            if new != self.placement[i]:
                self.pending.append((i, new))
        if not self.pending:
            self.balance = Balance()

    def _place(self, layer: int, slot_experts: list[int]) -> None:
        """A layer's placement: this rank holds its slots' experts (built from the checkpoint
        where it held none), every rank knows each expert's copies."""
        p = self.per_rank
        self.experts_loaded += self.layers[layer].hold(slot_experts[self.owner * p :][:p])
        old = self.placement.get(layer)
        if old is not None:
            self.moves.built += sum(
                len(set(slot_experts[o * p : (o + 1) * p]) - set(old[o * p : (o + 1) * p]))
                for o in range(self.slots // p)
            )
        self.placement[layer] = list(slot_experts)
        self._copies[layer] = copies_of(slot_experts, self.num_experts, self.device)

    def spread(self) -> dict[str, Any]:
        """The placement, what it has cost and what it bought, as /experts shows it (any
        thread: values read whole under the GIL)."""
        m = self.moves
        return {
            "ranks": self.ranks, "processes": self.ranks * self.columns, "slots": self.slots,
            "policy": self.policy,
            "placement": {str(i): p for i, p in self.placement.items()},
            "rank_tokens": {str(i): list(r) for i, r in m.rank_rows.items()},
            "imbalance": self.balance.imbalance, "imbalance_before_rebalance": m.before,
            "rebalances": m.plans, "experts_loaded": m.built,
            "longest_pause_ms": m.longest_pause_ns / 1e6,
        }  # fmt: skip

    def _compute(
        self, rows: torch.Tensor, local: torch.Tensor, moe: Moe, ops: LayerOps
    ) -> torch.Tensor:
        """Rows through the experts of this process's slots `local`."""
        start = time.perf_counter_ns()
        out = run_grouped(rows, 1, local, moe.slots, ops)
        self.timing.compute_ns += time.perf_counter_ns() - start
        self.timing.computed_rows += len(rows)
        return out

    def _all_to_all(self, x: torch.Tensor, into: list[int], out_of: list[int]) -> torch.Tensor:
        """x's rows, out_of[r] of them to rank r in order; into[r] rows from rank r back.
        DataRankLost where a rank is gone: the ranks cannot step on without it."""
        return self._start_all_to_all(x, into, out_of)()

    def _start_all_to_all(
        self, x: torch.Tensor, into: list[int], out_of: list[int]
    ) -> Callable[[], torch.Tensor]:
        """`_all_to_all` begun (the backend moves the rows on a thread or stream of its own);
        the call that waits for it and returns what came."""
        width = math.prod(x.shape[1:])
        wire = x.contiguous().view(len(x), width).view(torch.uint8)  # rows of bytes, as is
        got = wire.new_empty(sum(into), wire.shape[1])
        self.timing.sent_bytes += (sum(out_of) - out_of[self.rank]) * wire.shape[1]
        with lost_on_failure():
            work = self.pg.alltoall_base(got, wire, into, out_of, dist.AllToAllOptions())

        def arrived() -> torch.Tensor:
            with lost_on_failure():
                work.wait()
            return got.view(x.dtype).view(sum(into), *x.shape[1:])

        return arrived


def with_slots(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [n, hidden] and their slots [n] as rows of bytes [n, hidden bytes + 8]."""
    width = rows.shape[1] * rows.element_size()
    as_bytes = rows.contiguous().view(torch.uint8).view(len(rows), width)
    return torch.cat([as_bytes, slots.to(INT64).view(torch.uint8).view(len(rows), 8)], dim=1)


def without_slots(wire: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`with_slots` undone: the rows in `dtype` and their slots."""
    rows = wire[:, :-8].contiguous().view(dtype)
    return rows, wire[:, -8:].contiguous().view(INT64).flatten()


@contextlib.contextmanager
def lost_on_failure() -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # gloo's or NCCL's: a peer closed its end, or timed out
        raise DataRankLost(f"{type(e).__name__}: {e}") from e
