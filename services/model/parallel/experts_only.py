"""A data-parallel rank that holds experts and nothing else: the rank-0 layout's expert ranks
(`--expert-parallel`) as data-parallel ranks, the first step of folding that layout into this
one (docs/parallel.md). It never has requests of its own: every round it votes idle and runs
the empty pass another rank's pass needs, computing the rows sent to its experts, until a
vote carries a rank's stop (`Lockstep.finish`); then it leaves with the others.
"""

from __future__ import annotations

import time
from typing import Any

from services.model.causal_lm import CausalLM
from services.model.parallel import data

WAIT = 0.002  # seconds between idle votes: the worker's driver waits as long (ROUND_WAIT)
NOT_EXPERTS = ("layers", "embed", "lm_head", "norm", "attention", "mla")


def hold_experts(model: CausalLM, grid: data.Grid) -> data.Lockstep:
    """Join the grid with `model`'s MoE layers (this rank's slots' experts), and let the rest
    of the model go (the experts' build closures keep the model object, not what it held)."""
    lockstep = data.join(model, grid)
    shell: Any = model
    for name in NOT_EXPERTS:
        if hasattr(shell, name):
            setattr(shell, name, None)
    return lockstep


def serve(lockstep: data.Lockstep) -> None:
    """Empty passes whenever another rank runs a pass, until a rank stops the group."""
    while not lockstep.done:
        if not lockstep.idle():
            time.sleep(WAIT)
    lockstep.leave()
