"""Async scheduling on a CPU: decode tokens/s with it off and on, in one run.

    python -m bench.async_steps [--batches 1,32,256] [--rounds 3] [--dtype auto]

Per batch: that many sequences (32-token prompts) all decoding, 4 warm steps, then 64 timed
steps, the engine with `--async-scheduling off` and `on` in turn, `--rounds` times (the
median reported). On a CPU async scheduling runs the forward pass on a thread of its own while
the engine's thread applies the last step's tokens; `overlapped` is the share of the forward
pass's time the host spent applying them, `host` the share of a synchronous step outside the
forward pass (what async scheduling could hide at most).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.gpu_check.check import FULL, Check
from bench.gpu_check.throughput import engine_decode
from bench.offline import log
from services.engine.engine import Engine
from services.model.loader import resolve_dtype


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    device = torch.device("cpu")
    check = Check(device, FULL, False, time.monotonic() + 1e9, out=None)  # type: ignore[arg-type]
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    loaded = check.model(dtype)
    print(f"{dtype}, {torch.get_num_threads()} threads")
    rows: list[dict[str, Any]] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        runs: dict[str, list[float]] = {"off": [], "on": []}
        shares: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for overlap in ("off", "on") if r % 2 == 0 else ("on", "off"):
                log(f"  batch {batch}, round {r + 1}, async {overlap}")
                engines: list[Engine] = []
                d = engine_decode(check, loaded, batch, async_scheduling=overlap, keep=engines)
                runs[overlap].append(d.tok_s)
                t = engines[0].times
                total = t.schedule + t.forward + t.sample
                share = t.overlapped / t.forward if overlap == "on" else 1 - t.forward / total
                shares[overlap].append(share)
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        rows.append({"batch": batch, "off": off, "on": on, "ratio": on / off,
                     "host": statistics.median(shares["off"]),
                     "overlapped": statistics.median(shares["on"])})  # fmt: skip
    print(
        "| batch | decode tok/s, async off | async on | on / off | host share (off) "
        "| applied during forward (on) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['batch']} | {row['off']:.1f} | {row['on']:.1f} | {row['ratio']:.3f} | "
              f"{100 * row['host']:.1f}% | {100 * row['overlapped']:.1f}% |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
