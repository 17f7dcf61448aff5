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
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from services.model.causal_lm import CausalLM
from services.model.errors import DataRankLost, ModelLoadError
from services.model.experts import eplb
from services.model.experts.expert_parallel import Group, connect, copies_of, slot_of
from services.model.layers.layer_ops import LayerOps
from services.model.layers.moe import Moe, run_grouped

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
    the empty passes, and the exchanges inside real passes."""

    votes: int = 0
    vote_ns: int = 0
    empty_passes: int = 0
    empty_ns: int = 0
    exchanges: int = 0
    exchange_ns: int = 0


class ExpertExchange:
    """One rank's side of the all-to-all: a Dispatch for its MoE layers."""

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
    ) -> None:
        self.layers, self.pg, self.rank, self.ranks = layers, pg, rank, ranks
        self.ops, self.hidden, self.dtype, self.device = ops, hidden, dtype, device
        some = next(iter(layers.values()))
        self.num_experts = some.shape.num_experts
        self.balancing = balance or Balancing()
        self.slots = self.num_experts + self.balancing.redundant
        if self.slots % ranks:
            raise ValueError(f"{self.slots} expert slots do not divide over {ranks} ranks")
        self.per_rank = self.slots // ranks
        self.policy = eplb.choose_policy(
            self.balancing.policy, self.balancing.nodes, max(some.shape.n_group, 1), ranks,
            self.slots,
        )  # fmt: skip
        self._index = {id(moe): i for i, moe in layers.items()}
        self._first = min(layers)
        self.placement: dict[int, list[int]] = {}
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.passes = 0  # the same on every rank: each round with a pass runs one on each
        self.pending: list[tuple[int, list[int]]] = []  # a plan's layers still to move
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
        order = slot.argsort(stable=True)  # the choices grouped by slot, so by rank
        sent = torch.bincount(slot // self.per_rank, minlength=self.ranks)
        got = self._all_to_all(sent, [1] * self.ranks, [1] * self.ranks)
        sent_n, got_n = sent.tolist(), got.tolist()
        rows = self._all_to_all(x.index_select(0, order // k), got_n, sent_n)
        local = self._all_to_all(slot[order] % self.per_rank, got_n, sent_n)
        out = run_grouped(rows, 1, local, moe.slots, ops)
        back = self._all_to_all(out, sent_n, got_n)  # each rank's rows, computed
        per_choice = torch.empty_like(back)
        per_choice[order] = back  # back in (token, choice) order
        self.timing.exchanges += 1
        self.timing.exchange_ns += time.perf_counter_ns() - start
        return per_choice

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
        elif self.balancing.interval and self.passes % self.balancing.interval == 0:
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
            new = eplb.plan(row, self.placement[i], self.ranks, self.policy,
                            self.balancing.nodes, groups)  # fmt: skip
            if new != self.placement[i]:
                self.pending.append((i, new))

    def _place(self, layer: int, slot_experts: list[int]) -> None:
        """A layer's placement: this rank holds its slots' experts (built from the checkpoint
        where it held none), every rank knows each expert's copies."""
        p = self.per_rank
        self.experts_loaded += self.layers[layer].hold(slot_experts[self.rank * p :][:p])
        self.placement[layer] = list(slot_experts)
        self._copies[layer] = copies_of(slot_experts, self.num_experts, self.device)

    def _all_to_all(self, x: torch.Tensor, into: list[int], out_of: list[int]) -> torch.Tensor:
        """x's rows, out_of[r] of them to rank r in order; into[r] rows from rank r back.
        DataRankLost where a rank is gone: the ranks cannot step on without it."""
        width = math.prod(x.shape[1:])
        wire = x.contiguous().view(len(x), width).view(torch.uint8)  # rows of bytes, as is
        got = wire.new_empty(sum(into), wire.shape[1])
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
    """The ranks' agreement before each pass: see the module's docstring."""

    def __init__(self, exchange: ExpertExchange) -> None:
        self.exchange, self.pg = exchange, exchange.pg
        self.timing = exchange.timing
        self.voted = False  # this round's vote is cast (a pass ran)
        exchange.lockstep = self

    def vote(self, working: bool) -> bool:
        """Cast a round's vote; whether any rank has a pass to run."""
        start = time.perf_counter_ns()
        flag = torch.tensor([int(working)], dtype=INT64, device=self.exchange.device)
        with lost_on_failure():
            self.pg.allreduce([flag]).wait()
        self.timing.votes += 1
        self.timing.vote_ns += time.perf_counter_ns() - start
        return bool(flag.item())

    def snapshot(self) -> dict[str, Any]:
        """This rank's share of the agreement's cost, for /experts."""
        t, x = self.timing, self.exchange
        return {
            "rank": x.rank, "ranks": x.ranks, "votes": t.votes, "vote_ms": t.vote_ns / 1e6,
            "empty_passes": t.empty_passes, "empty_pass_ms": t.empty_ns / 1e6,
            "exchanges": t.exchanges, "exchange_ms": t.exchange_ns / 1e6,
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
        self.exchange.empty_pass()
        self.timing.empty_passes += 1
        self.timing.empty_ns += time.perf_counter_ns() - start
        return True

    def round_done(self) -> None:
        """After an engine step: a step that ran no pass still owes its round's vote."""
        if not self.voted:
            self.idle()
        self.voted = False


def join(
    model: CausalLM,
    rank: int,
    ranks: int,
    host: str,
    port: int,
    balance: Balancing | None = None,
) -> Lockstep:
    """Join the data-parallel group (rank 0 hosts its rendezvous at host:port), keep this
    rank's share of every MoE layer's experts, and answer the exchanges from here on."""
    layers = model.moe_layers()
    if not layers:
        raise ModelLoadError(model.config.name, "data-parallel ranks exchange a MoE model's rows")
    pg = connect(host, port, rank, ranks, model.device)
    ops = cast(Any, model).ops
    exchange = ExpertExchange(
        layers, pg, rank, ranks, ops, model.config.hidden_size, model.dtype, model.device,
        balance,
    )  # fmt: skip
    return Lockstep(exchange)
