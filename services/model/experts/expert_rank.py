"""An expert rank's process: rank 0 (a worker) starts ranks 1..N-1 with
expert_parallel.start, each runs `main` (python -m services.model.experts.expert_rank): it
loads the model through the same code as rank 0, so that its experts compute the same bits,
joins the group as an expert-only data-parallel rank (parallel/experts_only.py) and runs an
empty pass for each of rank 0's until rank 0 stops the group or is gone."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from services.model.errors import DataRankLost
from services.model.experts.eplb import Share
from services.model.experts.expert_parallel import Spec, slots_of
from services.model.parallel import data, experts_only
from services.model.parallel.group import exit_with_parent, rank_device

log = logging.getLogger("pdserve.experts")


def main(argv: list[str] | None = None) -> int:
    from services import logs
    from services.model.loader import load_model, resolve_device

    p = argparse.ArgumentParser(description=__doc__)
    for name in ("model", "dtype", "device", "kernels", "policy"):
        p.add_argument(f"--{name}", required=True)
    for name in ("ranks", "redundant", "nodes", "interval", "rank", "port", "threads"):
        p.add_argument(f"--{name}", type=int, required=True)
    a = p.parse_args(argv)
    logs.configure()
    exit_with_parent()
    torch.set_num_threads(a.threads)
    spec = Spec(a.model, a.dtype, a.device, a.kernels, a.ranks, a.redundant, a.policy, a.nodes,
                a.interval)  # fmt: skip
    device = rank_device(resolve_device(a.device), a.rank)
    share = Share(a.rank, a.ranks, a.redundant)  # its experts only are read
    model = load_model(a.model, a.dtype, str(device), kernels=a.kernels, experts=share).model
    slots_of(model, spec)
    grid = data.Grid(a.rank, a.ranks, f"127.0.0.1:{a.port}", spec.balance)
    try:
        lockstep = experts_only.hold_experts(model, grid)
        del model
        experts_only.serve(lockstep)
    except DataRankLost as e:  # rank 0 is gone: nothing to serve
        why = {"rank": a.rank, "why": str(e)[:200]}
        log.warning("expert rank: rank 0 gone", extra={"fields": why})
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not the interpreter's teardown: see data.Lockstep.leave
