"""The experts' all-to-all among data-parallel ranks (data.py): one process's side of it, a
Dispatch for its MoE layers.

At a MoE layer each rank routes its own tokens, gives each choice a slot holding a copy of its
expert (copies take turns: eplb.py), and sends every rank the rows bound for its slots
(dispatch); each rank computes the rows it received, from every rank, grouped by its slots,
and sends them back (combine). A row's bits do not depend on which copy, rank or batch
computed it (moe.py), so each rank's answers equal one process's.

Which slots hold which experts, and the balancer that moves them: balancer.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from services.model.layers.layer_ops import LayerOps
from services.model.layers.moe import Moe, run_grouped
from services.model.parallel.balancer import Balancer, Balancing
from services.model.parallel.group import Group, lost_on_failure
from services.model.parallel.tensor import TensorGroup

INT64 = torch.int64


class Voter(Protocol):
    """The ranks' agreement (data.Lockstep), as a pass's first MoE layer casts its vote."""

    def passing(self) -> None: ...


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
        self.balancer = Balancer(
            layers, ranks, rank * self.columns + self.column, ranks * self.columns,
            balance or Balancing(), pg, device,
        )  # fmt: skip
        self.per_rank = self.balancer.per_rank
        self._index = {id(moe): i for i, moe in layers.items()}
        self._first = min(layers)
        self.timing = LockstepTiming()
        for moe in layers.values():
            moe.dispatch = self
        self.lockstep: Voter | None = None  # casts a pass's vote at its first MoE layer

    def compute(
        self, moe: Moe, x: torch.Tensor, experts: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        layer = self._index[id(moe)]
        if layer == self._first:
            if self.lockstep is not None:
                self.lockstep.passing()
            self.balancer.between_passes()
        return self._exchange(layer, moe, x, experts, ops)

    def _exchange(
        self, layer: int, moe: Moe, x: torch.Tensor, experts: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        start = time.perf_counter_ns()
        k = len(experts) // len(x) if len(x) else 1
        slot = self.balancer.slot_of(layer, experts)
        owner = slot // self.per_rank
        columns = [torch.nonzero(owner % self.columns == c).flatten() for c in range(self.columns)]
        mine = columns[self.column]  # the choices this column computes
        order = slot[mine].argsort(stable=True)  # by slot, so by DP rank
        picked = mine[order]
        sent = torch.bincount(owner[picked] // self.columns, minlength=self.ranks)
        got = self._all_to_all(sent, [1] * self.ranks, [1] * self.ranks)
        sent_n, got_n = sent.tolist(), got.tolist()
        if len(experts):  # a pass of this rank's own
            self.balancer.count(layer, sent_n)
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
        self.balancer.between_passes()
        for i in sorted(self.layers):
            self._exchange(i, self.layers[i], rows, none, self.ops)

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
