"""Data-parallel ranks of a mixture-of-experts model (docs/parallel.md): N processes, each a
whole engine with its own requests, scheduler and paged cache, computing attention and the
dense layers for its own tokens only; the routed experts spread over all of them, every MoE
layer exchanging rows all-to-all.

At a MoE layer each rank routes its own tokens, gives each choice a slot holding a copy of its
expert (copies take turns, as with one routing rank: expert_parallel.py), and sends every rank
the rows bound for its slots (dispatch); each rank computes the rows it received, from every
rank, grouped by its slots, and sends them back (combine). A row's bits do not depend on which
copy, rank or batch computed it (moe.py), so each rank's answers equal one process's.

An all-to-all needs every rank, so the ranks keep in step (`Lockstep`): before each forward
pass they vote (an all-reduce of one flag); when any rank has a pass to run, each rank without
one runs an empty pass (its MoE layers' exchanges with no rows of its own, computing the rows
the others send it). Every round of a rank's loop is one vote: a pass's (the first MoE layer
casts it), or an idle one (`idle`), so the ranks' collectives pair up whatever their work.
A vote also carries a rank's request for a new placement (POST /experts/rebalance on any
rank): every rank then plans at the same pass, from every rank's loads.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from services.model.causal_lm import CausalLM
from services.model.errors import DataRankLost, ModelLoadError
from services.model.experts import eplb
from services.model.experts.eplb import copies_of, slot_of
from services.model.layers.layer_ops import LayerOps
from services.model.layers.moe import Moe, run_grouped
from services.model.parallel.group import Group, connect
from services.model.parallel.tensor import TensorGroup

INT64 = torch.int64


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
        self.plans = self.experts_loaded = 0
        for i, moe in layers.items():
            moe.dispatch = self
            self._place(i, eplb.initial(self.num_experts, self.slots))
        self.counts_at_plan = {i: moe.counts.clone() for i, moe in layers.items()}
        self.timing = LockstepTiming()
        self.lockstep: Lockstep | None = None  # casts a pass's vote at its first MoE layer

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
        rows = self._all_to_all(x.index_select(0, picked // k), got_n, sent_n)
        local = self._all_to_all(slot[picked] % self.per_rank, got_n, sent_n)
        out = run_grouped(rows, 1, local, moe.slots, ops)
        back = self._all_to_all(out, sent_n, got_n)  # this column's rows, computed
        per_choice = back.new_empty(len(experts), self.hidden)
        per_choice[picked] = back  # in (token, choice) order
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
            self._place(*self.pending.pop(0))
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
        self.plans += 1
        groups = max(self.layers[order[0]].shape.n_group, 1)
        for i, row in zip(order, load.tolist(), strict=True):
            if not any(row):
                continue
            new = eplb.plan(row, self.placement[i], self.ranks * self.columns, self.policy,
                            self.balancing.nodes, groups)  # fmt: skip
            if new != self.placement[i]:
                self.pending.append((i, new))

    def _place(self, layer: int, slot_experts: list[int]) -> None:
        """A layer's placement: this rank holds its slots' experts (built from the checkpoint
        where it held none), every rank knows each expert's copies."""
        p = self.per_rank
        self.experts_loaded += self.layers[layer].hold(slot_experts[self.owner * p :][:p])
        self.placement[layer] = list(slot_experts)
        self._copies[layer] = copies_of(slot_experts, self.num_experts, self.device)

    def _all_to_all(self, x: torch.Tensor, into: list[int], out_of: list[int]) -> torch.Tensor:
        """x's rows, out_of[r] of them to rank r in order; into[r] rows from rank r back.
        DataRankLost where a rank is gone: the ranks cannot step on without it."""
        width = math.prod(x.shape[1:])
        wire = x.contiguous().view(len(x), width).view(torch.uint8)  # rows of bytes, as is
        got = wire.new_empty(sum(into), wire.shape[1])
        self.timing.sent_bytes += (sum(out_of) - out_of[self.rank]) * wire.shape[1]
        with lost_on_failure():
            self.pg.alltoall_base(got, wire, into, out_of, dist.AllToAllOptions()).wait()
        return got.view(x.dtype).view(sum(into), *x.shape[1:])


@contextlib.contextmanager
def lost_on_failure() -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # gloo's or NCCL's: a peer closed its end, or timed out
        raise DataRankLost(f"{type(e).__name__}: {e}") from e


class Lockstep:
    """The ranks' agreement before each pass: see the module's docstring. With tensor ranks,
    the data-parallel rank's first (its worker) votes, and `around_empty` brings its tensor
    ranks into each empty pass."""

    def __init__(
        self,
        exchange: ExpertExchange,
        around_empty: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.exchange, self.pg = exchange, exchange.pg
        self.timing = exchange.timing
        self.around_empty = around_empty
        self.voted = False  # this round's vote is cast (a pass ran)
        self.asked = False  # a plan requested here, for the next vote to carry
        self.going = False  # this rank stops every rank: the next vote carries it
        self.done = False  # a vote carried a rank's stop: every rank leaves after it
        exchange.lockstep = self

    def vote(self, working: bool) -> bool:
        """Cast a round's vote (with this rank's request for a plan, and its stop, if any);
        whether any rank has a pass to run."""
        start = time.perf_counter_ns()
        asked, self.asked = self.asked, False
        flags = torch.tensor([int(working), int(asked), int(self.going)], dtype=INT64,
                             device=self.exchange.device)  # fmt: skip
        with lost_on_failure():
            self.pg.allreduce([flags]).wait()
        self.timing.votes += 1
        self.timing.vote_ns += time.perf_counter_ns() - start
        any_working, any_asked, any_going = flags.tolist()
        if any_asked:  # every rank saw it in the same vote: all plan at the same pass
            self.exchange.plan_asked = True
        self.done = self.done or bool(any_going)
        return bool(any_working)

    def finish(self) -> None:
        """Stop every rank (a rank whose others serve only it: an expert-only rank's loop ends
        at the vote that carries this), then leave with them."""
        self.going = True
        while not self.done:
            self.idle()
        self.leave()

    def request_rebalance(self) -> None:
        """Plan a new placement at the next pass, on every rank (any thread: the next vote
        carries it)."""
        self.asked = True

    def snapshot(self) -> dict[str, Any]:
        """This rank's share of the agreement's cost, for /experts."""
        t, x = self.timing, self.exchange
        return {
            "rank": x.rank, "ranks": x.ranks, "votes": t.votes, "vote_ms": t.vote_ns / 1e6,
            "empty_passes": t.empty_passes, "empty_pass_ms": t.empty_ns / 1e6,
            "exchanges": t.exchanges, "exchange_ms": t.exchange_ns / 1e6,
            "sent_bytes": t.sent_bytes,
            "passes": x.passes, "rebalances": x.plans, "experts_loaded": x.experts_loaded,
            "placement": {str(i): p for i, p in x.placement.items()},
        }  # fmt: skip

    def passing(self) -> None:
        """A pass of this rank's own begins (its first MoE layer): its round's vote."""
        self.vote(working=True)
        self.voted = True

    def idle(self) -> bool:
        """A round without a pass of this rank's own: vote so; run the empty pass when another
        rank runs one. Whether one ran."""
        if not self.vote(working=False):
            return False
        start = time.perf_counter_ns()
        with self.around_empty():
            self.exchange.empty_pass()
        self.timing.empty_passes += 1
        self.timing.empty_ns += time.perf_counter_ns() - start
        return True

    def leave(self) -> None:
        """Every rank done (all call it, after their last vote): meet once more, then close
        this end of the group, so that no rank's exit closes sockets the others still read.
        (A process holding groups made directly can still abort in the interpreter's teardown,
        SIGABRT, about 1 run in 20 on CPUs: tests and benchmarks end their rank processes
        with os._exit once their results are out.)"""
        with lost_on_failure():
            self.pg.barrier().wait()
        self.pg.shutdown()

    def round_done(self) -> None:
        """After an engine step: a step that ran no pass still owes its round's vote."""
        if not self.voted:
            self.idle()
        self.voted = False


@dataclass(frozen=True)
class Grid:
    """A process's place among the data-parallel ranks: its rank's, the count, where they
    meet (host:port, hosted by rank 0's first process), and the experts' balancing."""

    rank: int
    ranks: int
    address: str
    balance: Balancing = Balancing()

    def args(self) -> list[str]:
        b = self.balance
        return [
            "--dp-rank", str(self.rank), "--dp-ranks", str(self.ranks), "--dp-address",
            self.address, "--dp-balance", f"{b.redundant},{b.interval},{b.policy},{b.nodes}",
        ]  # fmt: skip

    @classmethod
    def parse(cls, rank: int, ranks: int, address: str, balance: str) -> Grid:
        redundant, interval, policy, nodes = balance.split(",")
        return cls(rank, ranks, address, Balancing(int(redundant), int(interval), policy,
                                                   int(nodes)))  # fmt: skip


def exchange(model: CausalLM, grid: Grid, tp: TensorGroup | None = None) -> ExpertExchange:
    """Join this process's column of the grid (tensor rank j of every data-parallel rank:
    one group each, meeting at grid.address) and keep its share of every MoE layer's
    experts: the exchanges answer from here on."""
    layers = model.moe_layers()
    if not layers:
        raise ModelLoadError(model.config.name, "data-parallel ranks exchange a MoE model's rows")
    column = tp.rank if tp is not None else 0
    host, _, port = grid.address.rpartition(":")
    pg = connect(host, int(port), grid.rank, grid.ranks, model.device,
                 hosts=grid.rank == 0 and column == 0, prefix=f"column-{column}/")  # fmt: skip
    ops = cast(Any, model).ops
    return ExpertExchange(
        layers, pg, grid.rank, grid.ranks, ops, model.config.hidden_size, model.dtype,
        model.device, grid.balance, tp,
    )  # fmt: skip


def join(
    model: CausalLM,
    grid: Grid,
    tp: TensorGroup | None = None,
    around_empty: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Lockstep:
    """A data-parallel rank's first process: its exchange and the votes (`tp`, `around_empty`:
    its tensor ranks, and how it brings them into an empty pass)."""
    return Lockstep(exchange(model, grid, tp), around_empty)
