"""`--tensor-parallel M` in a worker: rank 0 is the worker's own process and runs the engine
(scheduler, block manager, sampler, the KV seam) over its slice of the model; ranks 1..M-1
(`main`, started and watched by rank 0: `start`) hold the other slices and run every forward
pass rank 0 runs, on the same batch, each over its own heads' KV (docs/parallel.md).

Rank 0's model (`TensorParallelLM`) sends each pass's batch before computing it, and its pool
(`ShardedKV`) moves blocks whole: a block saved to the store gathers every rank's heads of it,
a block loaded from the store gives each rank its heads, so the store's blocks are the same
whatever M (a TP 2 prefill worker's blocks feed a TP 1 decode worker).

The wire: collectives over the tensor group, rank 0 the root. A header [command, n] is
broadcast, then the command's tensors:

    POOL n blocks       [block_size, replicated, G], then each of G early-released cache
                        groups' block count; every rank makes its pool of n blocks
    FORWARD n int64s    the batch's wire form (batch.py); the pass's own exchanges follow
    LOAD n blocks       the block ids, each group's blocks for them (rank 0's block manager
                        placed them), then K and V with every head: each rank keeps its own
    SAVE n blocks       the block ids; then each rank's heads of them, all-gathered
    EMPTY               an empty pass of the data-parallel grid's exchanges (data.py)
    STOP

Rank 0's engine thread runs the passes and its apply thread may save blocks meanwhile: a lock
keeps each command and its exchanges whole. A command that fails past its header leaves the
ranks out of step: the group is broken, every later command raises TensorRankLost, and the
worker leaves service (as a rank that died does).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from services.model.batch import ForwardBatch
from services.model.causal_lm import CausalLM
from services.model.config import ModelConfig
from services.model.errors import ModelLoadError, TensorRankLost
from services.model.experts.eplb import Share
from services.model.kv_cache import KVCache
from services.model.layers.moe import Moe
from services.model.parallel import data, plan
from services.model.parallel.exchange import ExpertExchange
from services.model.parallel.group import (
    RankProcesses,
    RankSpec,
    connect,
    exit_with_parent,
    rank_device,
)
from services.model.parallel.tensor import TensorGroup, parallelize

log = logging.getLogger("pdserve.tensor")
POOL, FORWARD, LOAD, SAVE, EMPTY, STOP = range(1, 7)
INT64 = torch.int64


@dataclass(frozen=True)
class Spec(RankSpec):
    """What every rank loads, how many ranks, and the data-parallel grid they are in."""

    grid: data.Grid | None = None  # the data-parallel ranks this worker is one of

    def args(self) -> list[str]:
        return [*super().args(), *(self.grid.args() if self.grid is not None else [])]


class Leader:
    """Rank 0's side of the group: its commands, one at a time, and the ranks' processes."""

    def __init__(self, group: TensorGroup, device: torch.device, spawned: RankProcesses) -> None:
        self.group, self.device, self.spawned = group, device, spawned
        self.broken: str | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def command(self, command: int, n: int) -> Iterator[TensorGroup]:
        """Send the header; the block sends the command's tensors and runs its exchanges."""
        with self._lock:
            if self.broken is not None:
                raise TensorRankLost(self.broken)
            try:
                self.group.broadcast(torch.tensor([command, n], dtype=INT64, device=self.device))
                yield self.group
            except Exception as e:
                self.broken = f"{type(e).__name__}: {e}"
                raise TensorRankLost(self.broken) from e

    @contextlib.contextmanager
    def empty(self) -> Iterator[None]:
        """The ranks in an empty pass of the grid's exchanges, run in the block."""
        with self.command(EMPTY, 0):
            yield

    def ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=INT64, device=self.device)

    def lost(self) -> str | None:
        """Why the group cannot serve: a rank process that exited, or a broken exchange."""
        return self.spawned.exited() or self.broken

    def stop(self, timeout: float = 10.0, kill: bool = False) -> None:
        """Tell the ranks to exit and wait for them (killed past `timeout`); `kill`: at once
        (the engine thread may be mid-exchange with them)."""
        if not kill and self.lost() is None:
            with contextlib.suppress(TensorRankLost), self.command(STOP, 0):
                pass
        self.spawned.wait(timeout, kill)


class ShardedKV(KVCache):
    """Rank 0's pool: its heads of every block, which its passes read and write; a block
    moved in or out of the engine is moved whole, every rank's heads of it (the store holds
    blocks as one process would). A `replicated` pool (latent attention's: one latent for all
    heads) is the same on every rank: saved from rank 0's alone, loaded into every rank's."""

    def __init__(self, local: KVCache, leader: Leader, replicated: bool) -> None:
        self.__dict__.update(local.__dict__)  # the pool's own tensors and groups
        self.local, self.leader, self.replicated = local, leader, replicated

    @property
    def plain(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # a stored block goes to every rank: written through write_blocks

    def block_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        (layers, heads, *k), (_, _, *v) = self.local.block_shapes()
        every = heads if self.replicated else heads * self.leader.group.size
        return (layers, every, *k), (layers, every, *v)

    def gather(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.replicated:  # rank 0's copy is every rank's: no exchange
            return self.local.gather(block_ids)
        with self.leader.command(SAVE, len(block_ids)) as group:
            group.broadcast(self.leader.ints(block_ids))
            k, v = self.local.gather(block_ids)  # [n, layers, heads, ...]: this rank's heads
            return group.gather(k, dim=2), group.gather(v, dim=2)

    def scatter(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.to(self.device, self.dtype), v.to(self.device, self.dtype)
        with self.leader.command(LOAD, len(block_ids)) as group:
            group.broadcast(self.leader.ints(block_ids))
            tables = self.local.tables(block_ids)  # where the block manager put their parts
            if tables:
                group.broadcast(self.leader.ints([x for t in tables for x in t]))
            group.broadcast(k)
            group.broadcast(v)
            _keep_mine(self.local, group, block_ids, k, v, self.replicated)


def _keep_mine(
    kv: KVCache,
    group: TensorGroup,
    block_ids: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    replicated: bool,
) -> None:
    """This rank's heads of whole blocks (K [n, layers, heads, ...], V alike) into its pool:
    all of them where the pool is `replicated`."""
    if replicated:
        kv.scatter(block_ids, k, v)
        return
    heads = kv.spec.heads
    mine = slice(group.rank * heads, (group.rank + 1) * heads)
    kv.scatter(block_ids, k[:, :, mine], v[:, :, mine])


class TensorParallelLM:
    """Rank 0's model: its slice (parallelize's exchanges in place), each pass's batch sent
    to the other ranks before it is computed. A CausalLM."""

    def __init__(self, inner: CausalLM, leader: Leader) -> None:
        self.inner, self.leader = inner, leader
        self.config: ModelConfig = inner.config  # this rank's heads
        # no captured graphs (a pass holds exchanges), no int8 (shard cuts float weights)
        self.capabilities = dataclasses.replace(
            inner.capabilities,
            cuda_graphs=False,
            int8=False,
            hidden_rows=False,
            approximate_reuse=False,
        )
        self.dtype, self.device, self.kernels = inner.dtype, inner.device, inner.kernels
        self.embed = inner.embed
        self.keep_hidden = False

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        assert isinstance(kv, ShardedKV)
        wire = batch.to_wire()
        with self.leader.command(FORWARD, len(wire)) as group:
            group.broadcast(wire)
            return self.inner.forward(batch, kv.local)

    def new_kv_cache(
        self, num_blocks: int, block_size: int, group_blocks: Mapping[str, int] | None = None
    ) -> KVCache:
        local = self.inner.new_kv_cache(num_blocks, block_size, group_blocks)
        replicated = plan.cache_whole(self.config)  # one latent or K=V head for every head
        mapped = [g.num_blocks for g in local.mapped]  # each early-released group's blocks
        with self.leader.command(POOL, num_blocks) as group:
            group.broadcast(self.leader.ints([block_size, int(replicated), len(mapped)]))
            if mapped:
                group.broadcast(self.leader.ints(mapped))
        return ShardedKV(local, self.leader, replicated)

    def moe_layers(self) -> dict[int, Moe]:
        return self.inner.moe_layers()

    def expert_counts(self) -> dict[int, list[int]]:
        return self.inner.expert_counts()  # every rank routes every token: rank 0's counts


def serve(group: TensorGroup, model: CausalLM, grid: ExpertExchange | None = None) -> None:
    """A rank's loop: rank 0's commands until STOP (RuntimeError if rank 0 is gone); `grid`:
    its exchange with the other data-parallel ranks, for empty passes."""
    device = model.device

    def ints(n: int) -> torch.Tensor:
        return group.broadcast(torch.empty(n, dtype=INT64, device=device))

    kv: KVCache | None = None
    replicated = False
    while True:
        command, n = ints(2).tolist()
        if command == STOP:
            return
        if command == POOL:
            block_size, replicated, groups = ints(3).tolist()
            counts = ints(groups).tolist() if groups else []
            early = [g.name for g in model.config.cache_spec.groups if not g.lasting]
            kv = model.new_kv_cache(n, block_size, dict(zip(early, counts, strict=True)))
            continue
        if command == EMPTY:
            assert grid is not None, "an empty pass outside a data-parallel grid"
            grid.empty_pass()
            continue
        assert kv is not None, "a pass before the pool"
        if command == FORWARD:
            model.forward(ForwardBatch.from_wire(ints(n)), kv)
        elif command == LOAD:
            block_ids = ints(n).tolist()
            parts = ints(n * len(kv.mapped)).tolist() if kv.mapped else []  # rank 0's places
            for g, group_cache in enumerate(kv.mapped):
                assert group_cache.table is not None
                for b, part in zip(block_ids, parts[g * n : (g + 1) * n], strict=True):
                    group_cache.table[b] = part
            s, bs = kv.spec, kv.block_size
            every = (n, s.layers, s.heads * (1 if replicated else group.size))  # K, V blocks
            k_all = torch.empty(*every, s.k_dim, bs, dtype=kv.dtype, device=device)
            v_all = torch.empty(*every, bs, s.v_dim, dtype=kv.dtype, device=device)
            k_all, v_all = group.broadcast(k_all), group.broadcast(v_all)
            _keep_mine(kv, group, block_ids, k_all, v_all, bool(replicated))
        elif command == SAVE:
            k_mine, v_mine = kv.gather(ints(n).tolist())
            group.gather(k_mine, dim=2)
            group.gather(v_mine, dim=2)


def start(model: CausalLM, spec: Spec, timeout: float = 3600.0) -> TensorParallelLM:
    """Start ranks 1..M-1 and the group around `model` (rank 0's slice, loaded from spec)."""
    gpus_needed = (model.device.index or 0) + spec.ranks
    if model.device.type == "cuda" and torch.cuda.device_count() < gpus_needed:
        raise ModelLoadError(spec.model, f"--tensor-parallel {spec.ranks} needs a GPU per rank")
    spawned = RankProcesses("services.model.parallel.ranks", spec.args(), spec.ranks,
                            threads_per_rank(spec.ranks), "tensor")  # fmt: skip
    pg = spawned.join(spec.model, spec.ranks, model.device, timeout)
    group = TensorGroup(pg, 0, spec.ranks)
    parallelize(model, group, experts=spec.grid is None)  # in a grid, the grid's exchange
    log.info("tensor parallel", extra={"fields": {"ranks": spec.ranks}})
    return TensorParallelLM(model, Leader(group, model.device, spawned))


def threads_per_rank(ranks: int) -> int:
    """A CPU's cores shared out between the ranks of one host (rank 0 included)."""
    return max(1, (os.cpu_count() or 1) // ranks)


def main(argv: list[str] | None = None) -> int:
    from services import logs
    from services.model.loader import load_model, resolve_device

    p = argparse.ArgumentParser(description=__doc__)
    for name in ("model", "dtype", "device", "kernels"):
        p.add_argument(f"--{name}", required=True)
    for name in ("ranks", "rank", "port", "threads"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dp-rank", type=int)
    p.add_argument("--dp-ranks", type=int)
    p.add_argument("--dp-address")
    p.add_argument("--dp-balance")
    a = p.parse_args(argv)
    grid = None
    if a.dp_ranks is not None:
        grid = data.Grid.parse(a.dp_rank, a.dp_ranks, a.dp_address, a.dp_balance)
    logs.configure()
    exit_with_parent()
    torch.set_num_threads(a.threads)
    device = rank_device(resolve_device(a.device), a.rank)
    share = None  # in a grid, process (d, j) holds the (d M + j)-th share of the experts
    if grid is not None:
        share = Share(grid.rank * a.ranks + a.rank, grid.ranks * a.ranks, grid.balance.redundant)
    model = load_model(a.model, a.dtype, str(device), kernels=a.kernels,
                       tensor=(a.rank, a.ranks), experts=share).model  # fmt: skip
    try:
        group = TensorGroup(connect("127.0.0.1", a.port, a.rank, a.ranks, device), a.rank, a.ranks)
        parallelize(model, group, experts=grid is None)
        serve(group, model, data.exchange(model, grid, group) if grid else None)
    except RuntimeError as e:  # rank 0 is gone: nothing to serve
        why = {"rank": a.rank, "why": str(e)[:200]}
        log.warning("tensor rank: rank 0 gone", extra={"fields": why})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
