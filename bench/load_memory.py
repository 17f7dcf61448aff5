"""What one process of several holds after loading: a model whole, a tensor rank's slice of it,
or a share of its routed experts.

    python -m bench.load_memory [--dtype bfloat16] [--dense DIR] [--moe DIR]

Each row loads in a fresh process and reports its peak resident memory before loading (torch
and pdserve imported) and after: the difference is what loading the model took, its transient
copies included (a checkpoint stored in float32 is read as stored, then cast). The dense model
is the embedded one (its 3 KV heads split over 3 tensor ranks: `load_model(tensor=(r, 3))`
reads each split tensor's rows of rank r only); the MoE model bench.deepseek's DeepSeek-V3-
shaped checkpoint (`load_model(experts=Share(0, N))` reads process 0's share of the experts).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

LOAD = """
import json, resource, sys
from services.model.experts.eplb import Share
from services.model.loader import load_model
path, dtype, rank, ranks, owners = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_model(path, dtype, "cpu", tensor=(rank, ranks),
                   experts=Share(0, owners) if owners > 1 else None).model
built = sum(e is not None for moe in model.moe_layers().values() for e in moe.experts)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before": before, "after": after, "experts": built}))
"""


def load(path: Path, dtype: str, tensor: tuple[int, int] = (0, 1), owners: int = 1) -> dict:
    """One fresh process's peaks, KiB, and the experts its model built."""
    args = [str(path), dtype, str(tensor[0]), str(tensor[1]), str(owners)]
    out = subprocess.run([sys.executable, "-c", LOAD, *args], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return dict(json.loads(out.splitlines()[-1]))


def _mib(kib: int) -> str:
    return f"{kib / 1024:,.0f} MiB"


def tensor_table(path: Path, dtype: str, ranks: int = 3) -> str:
    rows = [
        "| process | peak before loading | peak after | loading took |",
        "|---|---|---|---|",
    ]
    for name, tensor in [("whole", (0, 1)), *((f"tensor rank {r} of {ranks}", (r, ranks))
                                              for r in range(ranks))]:  # fmt: skip
        got = load(path, dtype, tensor)
        rows.append(f"| {name} | {_mib(got['before'])} | {_mib(got['after'])} | "
                    f"{_mib(got['after'] - got['before'])} |")  # fmt: skip
    return "\n".join(rows)


def experts_table(path: Path, dtype: str) -> str:
    rows = [
        "| processes the experts spread over | experts built (all layers) | peak before "
        "loading | peak after | loading took |",
        "|---|---|---|---|---|",
    ]
    for owners in (1, 2, 4):
        got = load(path, dtype, owners=owners)
        rows.append(f"| {owners} | {got['experts']} | {_mib(got['before'])} | "
                    f"{_mib(got['after'])} | {_mib(got['after'] - got['before'])} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from bench.deepseek import checkpoint
    from services.model.loader import cpu_has_bf16_units
    from services.model.loading.sources import resolve

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16" if cpu_has_bf16_units() else "float32")
    p.add_argument("--dense", default="embedded", help="a dense model (3 tensor ranks)")
    p.add_argument("--moe", type=Path, default=None, help="a MoE checkpoint directory")
    a = p.parse_args(argv)
    print(f"{platform.processor() or platform.machine()}, {a.dtype}\n")
    print(tensor_table(resolve(a.dense), a.dtype) + "\n")
    print(experts_table(a.moe or checkpoint(), a.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
