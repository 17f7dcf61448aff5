"""Async scheduling on a CPU: decode tokens/s with it off and on, in one run.

    python -m bench.async_steps [--batches 1,32,256] [--rounds 3] [--dtype auto]
    python -m bench.async_steps --speculative ngram [--batches 1,8] [--rounds 3]

Per batch: that many sequences (32-token prompts) all decoding, 4 warm steps, then 64 timed
steps, the engine with `--async-scheduling off` and `on` in turn, `--rounds` times (the
median reported). On a CPU async scheduling runs the forward pass on a thread of its own while
the engine's thread applies the last step's tokens; `overlapped` is the share of the forward
pass's time the host spent applying them, `host` the share of a synchronous step outside the
forward pass (what async scheduling could hide at most).

With `--speculative`: per batch, that many chat prompts asking to repeat a text (n-gram
proposals find it), 64 tokens each, run to the end with async scheduling off and on: output
tokens/s of the whole run (a step's tokens vary with what is accepted).
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
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.loader import LoadedModel, resolve_dtype
from services.settings import SpeculativeConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--speculative", default=None, help="ngram or suffix")
    args = ap.parse_args(argv)
    device = torch.device("cpu")
    check = Check(device, FULL, False, time.monotonic() + 1e9, out=None)  # type: ignore[arg-type]
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    loaded = check.model(dtype)
    print(f"{dtype}, {torch.get_num_threads()} threads")
    if args.speculative:
        return speculating(loaded, args)
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
        print(
            f"| {row['batch']} | {row['off']:.1f} | {row['on']:.1f} | {row['ratio']:.3f} | "
            f"{100 * row['host']:.1f}% | {100 * row['overlapped']:.1f}% |"
        )
    return 0


ASK = "Repeat this text exactly:\n"
TEXTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the branch.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday",
]


def speculating(loaded: LoadedModel, args: argparse.Namespace) -> int:
    spec = SpeculativeConfig(args.speculative, max_batch=1024)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    print("| batch | output tok/s, async off | async on | on / off | accepted / proposed |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for batch in [int(b) for b in args.batches.split(",")]:
        texts = [TEXTS[i % len(TEXTS)] for i in range(batch)]
        prompts = [
            loaded.tokenizer.encode_chat([{"role": "user", "content": ASK + t}]) for t in texts
        ]
        runs: dict[str, list[float]] = {"off": [], "on": []}
        stats = None
        for r in range(args.rounds):
            for overlap in ("off", "on") if r % 2 == 0 else ("on", "off"):
                log(f"  batch {batch}, round {r + 1}, async {overlap}")
                config = EngineConfig(
                    num_blocks=batch * 8 + 8, speculative=spec, async_scheduling=overlap
                )
                engine = Engine(loaded.model, loaded.tokenizer, config)
                engine.generate(prompts[:1], params)  # warm
                start = time.perf_counter()
                out = engine.generate(prompts, params)
                seconds = time.perf_counter() - start
                runs[overlap].append(sum(len(o.choices[0].token_ids) for o in out) / seconds)
                stats = engine.speculator.stats if engine.speculator else None
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        kept = f"{stats.accepted} / {stats.proposed}" if stats else "-"
        print(f"| {batch} | {off:.1f} | {on:.1f} | {on / off:.3f} | {kept} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
