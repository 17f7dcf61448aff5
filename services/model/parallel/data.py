"""Data-parallel ranks of a mixture-of-experts model (docs/parallel.md): N processes, each a
whole engine with its own requests, scheduler and paged cache, computing attention and the
dense layers for its own tokens only; the routed experts spread over all of them, every MoE
layer exchanging rows all-to-all (exchange.py).

An all-to-all needs every rank, so the ranks keep in step (`Lockstep`): before each forward
pass they vote (one all-reduce); when any rank has a pass to run, each rank without one runs
an empty pass (its MoE layers' exchanges with no rows of its own, computing the rows the
others send it). Every round of a rank's loop is one vote: a pass's (the first MoE layer
casts it), or an idle one (`idle`), so the ranks' collectives pair up whatever their work.
A vote also carries a rank's request for a new placement (POST /experts/rebalance on any
rank: every rank then plans at the same pass, from every rank's loads), a rank's stop (every
rank leaves after it), and each rank's expert work so far (rows and compute time, in its own
slot), so that every rank knows every rank's as of the last vote.

The rank-0 layout (`--expert-parallel N`) is a case of this one: rank 0 has every request and
ranks 1..N-1 hold experts only (experts_only.py), running an empty pass for each of rank 0's.
Rank 0 is then `alone`: no other rank ever has a pass, so it votes only at its own passes and
the others wait inside the vote's all-reduce meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from services.model.causal_lm import CausalLM
from services.model.errors import ModelLoadError
from services.model.parallel.balancer import Balancing
from services.model.parallel.exchange import INT64, ExpertExchange
from services.model.parallel.group import connect, lost_on_failure
from services.model.parallel.tensor import TensorGroup


class Lockstep:
    """The ranks' agreement before each pass: see the module's docstring. With tensor ranks,
    the data-parallel rank's first (its worker) votes, and `around_empty` brings its tensor
    ranks into each empty pass."""

    def __init__(
        self,
        exchange: ExpertExchange,
        around_empty: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        alone: bool = False,
    ) -> None:
        self.exchange, self.pg = exchange, exchange.pg
        self.alone = alone  # the only rank with requests: no idle votes (module docstring)
        self.timing = exchange.timing
        self.around_empty = around_empty
        self.voted = False  # this round's vote is cast (a pass ran)
        self.asked = False  # a plan requested here, for the next vote to carry
        self.going = False  # this rank stops every rank: the next vote carries it
        self.done = False  # a vote carried a rank's stop: every rank leaves after it
        self.computed = [(0, 0)] * exchange.ranks  # each rank's (rows, ns) as of the last vote
        exchange.lockstep = self

    def vote(self, working: bool) -> bool:
        """Cast a round's vote (with this rank's request for a plan, and its stop, if any);
        whether any rank has a pass to run."""
        start = time.perf_counter_ns()
        asked, self.asked = self.asked, False
        x, t = self.exchange, self.timing
        flags = torch.zeros(3 + 2 * x.ranks, dtype=INT64, device=x.device)
        flags[:3] = torch.tensor([int(working), int(asked), int(self.going)])
        flags[3 + 2 * x.rank :][:2] = torch.tensor([t.computed_rows, t.compute_ns])
        with lost_on_failure():
            self.pg.allreduce([flags]).wait()
        t.votes += 1
        t.vote_ns += time.perf_counter_ns() - start
        any_working, any_asked, any_going, *work = flags.tolist()
        self.computed = list(zip(work[::2], work[1::2], strict=True))
        if any_asked:  # every rank saw it in the same vote: all plan at the same pass
            self.exchange.balancer.plan_asked = True
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
        t, x, b = self.timing, self.exchange, self.exchange.balancer
        return {
            "rank": x.rank, "ranks": x.ranks, "votes": t.votes, "vote_ms": t.vote_ns / 1e6,
            "empty_passes": t.empty_passes, "empty_pass_ms": t.empty_ns / 1e6,
            "exchanges": t.exchanges, "exchange_ms": t.exchange_ns / 1e6,
            "sent_bytes": t.sent_bytes,
            "passes": b.passes, "rebalances": b.moves.plans, "experts_loaded": b.experts_loaded,
            "placement": {str(i): p for i, p in b.placement.items()},
            "rank_rows_computed": [rows for rows, _ in self.computed],
            "rank_compute_ms": [ns / 1e6 for _, ns in self.computed],
        }  # fmt: skip

    def spread(self) -> dict[str, Any]:
        """The experts' placement and balance, as /experts' `parallel` shows them."""
        return self.exchange.balancer.spread()

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
        """After an engine step: a step that ran no pass still owes its round's vote (alone:
        nobody waits for it)."""
        if not self.voted and not self.alone:
            self.idle()
        self.voted = False


@dataclass(frozen=True)
class Grid:
    """A process's place among the data-parallel ranks: its rank's, the count, where they
    meet (host:port, hosted by rank 0's first process), and the experts' balancing."""

    rank: int
    ranks: int
    address: str
    balance: Balancing = field(default_factory=Balancing)

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


def exchange(
    model: CausalLM,
    grid: Grid,
    tp: TensorGroup | None = None,
    check: Callable[[], None] = lambda: None,
) -> ExpertExchange:
    """Join this process's column of the grid (tensor rank j of every data-parallel rank:
    one group each, meeting at grid.address) and keep its share of every MoE layer's
    experts: the exchanges answer from here on. `check` raises while joining where the
    others cannot come (group.connect)."""
    layers = model.moe_layers()
    if not layers:
        raise ModelLoadError(model.config.name, "data-parallel ranks exchange a MoE model's rows")
    column = tp.rank if tp is not None else 0
    host, _, port = grid.address.rpartition(":")
    pg = connect(host, int(port), grid.rank, grid.ranks, model.device, check=check,
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
    alone: bool = False,
    check: Callable[[], None] = lambda: None,
) -> Lockstep:
    """A data-parallel rank's first process: its exchange and the votes (`tp`, `around_empty`:
    its tensor ranks, and how it brings them into an empty pass; `alone`: the others hold
    experts only)."""
    return Lockstep(exchange(model, grid, tp, check), around_empty, alone)
