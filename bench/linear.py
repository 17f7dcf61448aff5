"""The model's products by a weight, bfloat16: AMX tiles (ours), oneDNN held to AVX-512, and
oneDNN on AMX, on the embedded model's shapes at the row counts a server sees. On a CPU with
AVX512-BF16 and no AMX tiles: kernels/bf16_linear.c (ours there) against oneDNN.

    python -m bench.linear [--rows 1,8,32,256,512,1024] [--rounds 30]

`AmxLinear` (kernels/amx_linear.c) and oneDNN held to AVX-512's bfloat16 kernels (what pdserve
leaves to oneDNN, `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`) are timed in this process; oneDNN with
its AMX kernels (`ONEDNN_MAX_CPU_ISA=ALL`, not row-invariant: what vLLM runs) in a child process,
since oneDNN reads the variable once. Each figure is the fastest of `--rounds` calls after a
warm-up (the machines are shared: the fastest is the least disturbed), the weight's product
repeated on the same input. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from services.model.layers.linear import (
    AmxLinear,
    Bf16Linear,
    PackedLinear,
    amx_linear_library,
    bf16_linear_library,
)

# (out, in) of the embedded model's q/k/v, o, gate/up and down products and its output head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
HEAD_ROWS = 64  # the head computes only the rows that sample: at most a decode batch


def fastest(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rounds: int) -> float:
    linear(x)
    best = float("inf")
    for _ in range(rounds):
        begin = time.perf_counter()
        linear(x)
        best = min(best, time.perf_counter() - begin)
    return best


def cases(rows: list[int]) -> list[tuple[int, int, int]]:
    return [(o, i, m) for o, i in SHAPES for m in rows if o < 10_000 or m <= HEAD_ROWS]


def measure(kind: str, rows: list[int], rounds: int) -> dict[str, float]:
    """Seconds per call, by "out,in,rows", for `kind` (tiles or onednn)."""
    amx, bf16 = amx_linear_library(), bf16_linear_library()
    out: dict[str, float] = {}
    for out_f, in_f, m in cases(rows):
        gen = torch.Generator().manual_seed(out_f + in_f)
        weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(torch.bfloat16)
        x = torch.randn(m, in_f, generator=gen).to(torch.bfloat16)
        linear: AmxLinear | Bf16Linear | PackedLinear
        if kind == "tiles":
            if amx is None:
                continue
            linear = AmxLinear(amx, weight)
        elif kind == "bf16":
            if bf16 is None:
                continue
            linear = Bf16Linear(bf16, weight, out_dtype=torch.bfloat16)
        else:
            linear = PackedLinear(weight)
        out[f"{out_f},{in_f},{m}"] = fastest(linear, x, rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,8,32,256,512,1024")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--only", choices=["onednn"], help=argparse.SUPPRESS)  # the child's part
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.only:
        print(json.dumps(measure(args.only, rows, args.rounds)))
        return 0
    if amx_linear_library() is None:
        if bf16_linear_library() is None:
            print("neither AMX tiles nor AVX512-BF16 here: nothing to compare")
            return 1
        return bf16_table(rows, args.rounds)
    tiles, held = measure("tiles", rows, args.rounds), measure("onednn", rows, args.rounds)
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.linear",
            "--only",
            "onednn",
            "--rows",
            args.rows,
            "--rounds",
            str(args.rounds),
        ],
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": "ALL"},
        capture_output=True,
        text=True,
        check=True,
    )
    onednn_amx = json.loads(child.stdout.strip().splitlines()[-1])
    table(
        tiles,
        args.rounds,
        [
            "AMX tiles (ours) us",
            "GFLOP/s",
            "oneDNN AVX-512 us",
            "oneDNN AMX us",
            "ours vs AVX-512",
            "ours vs oneDNN AMX",
        ],
        lambda key, seconds, flop: [
            f"{seconds * 1e6:.0f}",
            f"{flop / seconds / 1e9:.0f}",
            f"{held[key] * 1e6:.0f}",
            f"{onednn_amx[key] * 1e6:.0f}",
            f"{held[key] / seconds:.2f}x",
            f"{onednn_amx[key] / seconds:.2f}x",
        ],
    )
    return 0


def bf16_table(rows: list[int], rounds: int) -> int:
    """kernels/bf16_linear.c against oneDNN, where the CPU has AVX512-BF16 and no AMX."""
    ours, onednn = measure("bf16", rows, rounds), measure("onednn", rows, rounds)
    table(
        ours,
        rounds,
        ["bf16_linear.c us", "GFLOP/s", "oneDNN us", "GFLOP/s", "ours vs oneDNN"],
        lambda key, seconds, flop: [
            f"{seconds * 1e6:.0f}",
            f"{flop / seconds / 1e9:.0f}",
            f"{onednn[key] * 1e6:.0f}",
            f"{flop / onednn[key] / 1e9:.0f}",
            f"{onednn[key] / seconds:.2f}x",
        ],
    )
    return 0


def table(
    ours: dict[str, float],
    rounds: int,
    head: list[str],
    cells: Callable[[str, float, int], list[str]],
) -> None:
    """A Markdown row per shape and row count: `cells(key, our seconds, FLOPs)` after them."""
    print(f"bfloat16 products, {torch.get_num_threads()} threads, fastest of {rounds} calls")
    print("\n| out x in | rows | " + " | ".join(head) + " |")
    print("| --- | ---: |" + " ---: |" * len(head))
    for key, seconds in ours.items():
        out_f, in_f, m = map(int, key.split(","))
        flop = 2 * out_f * in_f * m
        print(f"| {out_f} x {in_f} | {m} | " + " | ".join(cells(key, seconds, flop)) + " |")


if __name__ == "__main__":
    sys.exit(main())
