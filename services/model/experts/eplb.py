"""The expert-parallel load balancer's planner: which expert each slot holds, from the load
each expert took.

A MoE layer's experts live in `slots` slots spread evenly over `ranks` processes (rank r holds
slots [r * per_rank, (r + 1) * per_rank)); slots beyond one per expert are redundant and hold
second copies. A choice of expert e goes to one of e's copies, in turn (expert_parallel.py), so
each copy takes load(e) / copies(e). A layer waits on its busiest rank: a placement is as good
as max over mean of the ranks' loads (`imbalance`, 1.0 is perfect).

Two policies, as DeepSeek's EPLB describes them:
- global: copies go to the hottest experts one at a time (the expert with the most load per
  copy gets the next), then copies are packed onto ranks heaviest first, each to the lightest
  rank with a free slot. Right for decode's wide expert parallelism, where a rank holds few
  experts and any expert may go anywhere.
- hierarchical: the model's expert groups (DeepSeek-V3 routes a token to its `topk_group` best
  groups of `n_group`) are packed onto nodes first, so a token's experts stay on few nodes, and
  each node then replicates and packs its own experts onto its ranks. Right when ranks span
  nodes whose links are slower than the links inside one (prefill's smaller groups), and only
  where the nodes divide the groups, ranks and slots.
Both keep an expert in the slot it had where it stays on that rank: only moved experts load.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

POLICIES = ("auto", "hierarchical", "global")


def initial(num_experts: int, slots: int) -> list[int]:
    """Before any load is known: slot s holds expert s % experts (the redundant slots second
    copies of the first experts)."""
    return [s % num_experts for s in range(slots)]


@dataclass(frozen=True)
class Share:
    """One process's share of every MoE layer's slots: process `owner` of `owners`, each
    holding (experts + `redundant`) / owners slots in turn."""

    owner: int
    owners: int
    redundant: int = 0

    def experts(self, num_experts: int) -> frozenset[int]:
        """The experts this process's slots hold at start (`initial`): what it reads at load."""
        slots = num_experts + self.redundant
        per = slots // self.owners
        return frozenset(initial(num_experts, slots)[self.owner * per :][:per])


def choose_policy(policy: str, nodes: int, groups: int, ranks: int, slots: int) -> str:
    """`auto`: hierarchical where the ranks span nodes that divide everything, else global."""
    fits = nodes > 1 and groups % nodes == 0 and ranks % nodes == 0 and slots % nodes == 0
    if policy == "hierarchical" and not fits:
        raise ValueError(
            f"the hierarchical policy needs --eplb-nodes > 1 dividing the {groups} expert "
            f"groups, {ranks} ranks and {slots} slots; got {nodes} nodes"
        )
    if policy == "auto":
        return "hierarchical" if fits else "global"
    return policy


def plan(
    load: Sequence[float],
    current: Sequence[int],
    ranks: int,
    policy: str = "global",
    nodes: int = 1,
    groups: int = 1,
) -> list[int]:
    """The expert of each slot (len(current) slots, evenly over `ranks`), from each expert's
    load (`policy`: global or hierarchical, as `choose_policy` settled it)."""
    per_rank = len(current) // ranks
    if policy == "global":
        return _place(load, list(range(len(load))), current, list(range(ranks)), per_rank)
    per_group, per_node = len(load) // groups, ranks // nodes
    group_load = [sum(load[g * per_group : (g + 1) * per_group]) for g in range(groups)]
    out = list(current)
    for node, held in enumerate(_pack(group_load, list(range(groups)), nodes, groups // nodes)):
        experts = [g * per_group + i for g in sorted(held) for i in range(per_group)]
        node_ranks = list(range(node * per_node, (node + 1) * per_node))
        placed = _place(load, experts, current, node_ranks, per_rank)
        span = slice(node_ranks[0] * per_rank, (node_ranks[-1] + 1) * per_rank)
        out[span] = placed[span]
    return out


def replicate(load: Sequence[float], slots: int) -> list[int]:
    """Copies of each expert, `slots` in all: one each, then each further copy to the expert
    with the most load per copy (ties: the lower id)."""
    copies = [1] * len(load)
    for _ in range(slots - len(load)):
        hottest = max(range(len(load)), key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    return copies


def imbalance(load: Sequence[float], slot_experts: Sequence[int], ranks: int) -> float:
    """max over mean of the ranks' loads under this placement, each expert's load shared
    evenly by its copies (1.0: balanced; 1.0 also with no load)."""
    per_rank, copies = len(slot_experts) // ranks, Counter(slot_experts)
    rank_load = [
        sum(load[e] / copies[e] for e in slot_experts[r * per_rank : (r + 1) * per_rank])
        for r in range(ranks)
    ]
    mean = sum(rank_load) / ranks
    return max(rank_load) / mean if mean else 1.0


def _place(
    load: Sequence[float],
    experts: list[int],
    current: Sequence[int],
    ranks: list[int],
    per_rank: int,
) -> list[int]:
    """`experts` replicated into the slots of `ranks` and packed onto them; other slots keep
    `current`."""
    copies = replicate([load[e] for e in experts], per_rank * len(ranks))
    items = [(load[e] / copies[i], e) for i, e in enumerate(experts) for _ in range(copies[i])]
    packs = _pack([w for w, _ in items], [e for _, e in items], len(ranks), per_rank)
    out = list(current)
    for r, held in zip(ranks, packs, strict=True):
        span = slice(r * per_rank, (r + 1) * per_rank)
        out[span] = _keep_in_place(current[span], held)
    return out


def _pack(weights: Sequence[float], items: Sequence[int], bins: int, size: int) -> list[list[int]]:
    """`items` into `bins` bins of `size` each, heaviest first, each to the lightest bin with
    room (ties: one without a copy of the item, then the lower bin)."""
    order = sorted(range(len(items)), key=lambda i: (-weights[i], items[i]))
    packs: list[list[int]] = [[] for _ in range(bins)]
    totals = [0.0] * bins
    for i in order:
        open_bins = [b for b in range(bins) if len(packs[b]) < size]
        b = min(open_bins, key=lambda b: (totals[b], items[i] in packs[b], b))
        packs[b].append(items[i])
        totals[b] += weights[i]
    return packs


def _keep_in_place(current: Sequence[int], held: list[int]) -> list[int]:
    """`held` in a rank's slots, an expert the rank keeps in the slot it was in."""
    left = Counter(held)
    out: list[int | None] = []
    for e in current:
        if left[e]:
            left[e] -= 1
            out.append(e)
        else:
            out.append(None)
    rest = iter(sorted(left.elements()))
    return [e if e is not None else next(rest) for e in out]


def copies_of(
    slot_experts: list[int], num_experts: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's slots [experts, most copies] (an expert with fewer repeats its first) and
    its count of copies [experts]: what `slot_of` reads."""
    by_expert: list[list[int]] = [[] for _ in range(num_experts)]
    for s, e in enumerate(slot_experts):
        by_expert[e].append(s)
    width = max(len(c) for c in by_expert)
    copies = torch.tensor([c + c[:1] * (width - len(c)) for c in by_expert], device=device)
    return copies, torch.tensor([len(c) for c in by_expert], device=device)


def slot_of(copies: torch.Tensor, count: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Each choice's slot: the n-th choice of expert e in the batch takes e's copies in turn,
    so each copy takes its share."""
    order = experts.argsort(stable=True)
    per_expert = torch.bincount(experts, minlength=len(count))
    first = per_expert.cumsum(0) - per_expert
    nth = torch.empty_like(experts)
    nth[order] = torch.arange(len(experts), device=experts.device) - first[experts[order]]
    return copies[experts, nth % count[experts]]
