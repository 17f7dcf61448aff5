"""What keeping data-parallel ranks in step costs, on this machine.

    python -m bench.data_parallel [--dtype auto] [--seqs 8] [--prompt-len 64]
                                  [--max-tokens 32] [--model DIR]

On bench.deepseek's random DeepSeek-V3-shaped checkpoint (MLA, 7 MoE layers of 32 experts)
unless --model names another MoE checkpoint, every process with one thread, three runs of
`--seqs` random prompts (greedy) per busy rank, as one Markdown table:

1. one process holding every expert: the baseline pass;
2. two data-parallel ranks (services/model/parallel/data.py), both busy, each with its own
   prompts and half the experts: a pass, and of it the vote and the MoE exchanges (dispatch,
   the rows received computed, combine);
3. two ranks, rank 1 idle: rank 0's pass, and rank 1's empty passes (its exchanges alone).

Every rank's tokens are checked against one process's for the same prompts. On 2 cores the
ranks do not share cores, but the figures are overheads (a vote, an exchange), not speed-ups:
docs/benchmarks.md carries them.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import platform
import sys
import time
from pathlib import Path

import torch

from bench.deepseek import checkpoint, log
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.launcher import free_port
from services.model.loader import load_model
from services.model.parallel import data

ARRIVALS = itertools.count()


def prompts(seqs: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(seqs)]


def run(engine: Engine, batch: list[list[int]], params: SamplingParams, lockstep=None):
    """Each prompt's tokens, the passes and the seconds, stepping the engine by hand."""
    ids = [f"r{next(ARRIVALS)}" for _ in batch]
    for rid, prompt in zip(ids, batch, strict=True):
        engine.add_request(EngineRequest(rid, prompt, params))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    passes, start = 0, time.perf_counter()
    while engine.has_unfinished:
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
        passes += 1
        if lockstep is not None:
            lockstep.round_done()
    return [tokens[rid] for rid in ids], passes, time.perf_counter() - start


def _rank(path: str, dtype: str, rank: int, port: int, busy: bool, args, out) -> None:
    torch.set_num_threads(1)
    loaded = load_model(path, dtype=dtype, device="cpu")
    lockstep = data.join(loaded.model, data.Grid(rank, 2, f"127.0.0.1:{port}"))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=1024))
    warm = prompts(2, args.prompt_len, 99)
    run(engine, warm, params, lockstep)  # both ranks warm up together
    while lockstep.idle():
        pass
    before = lockstep.snapshot()
    batch = prompts(args.seqs, args.prompt_len, rank) if busy else []
    tokens, passes, seconds = run(engine, batch, params, lockstep)
    while lockstep.idle():  # the other rank's passes, until neither has one
        pass
    after = lockstep.snapshot()  # since the warm-up:
    since = {k: v - before[k] for k, v in after.items() if isinstance(v, int | float)}
    lockstep.leave()
    out.put((rank, tokens, passes, seconds, since))


def ranks(path: Path, dtype: str, args, busy: tuple[bool, bool]) -> dict[int, tuple]:
    spawn = multiprocessing.get_context("spawn")
    out, port = spawn.Queue(), free_port()
    procs = [
        spawn.Process(target=_rank, args=(str(path), dtype, r, port, busy[r], args, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got = {r: rest for r, *rest in (out.get(timeout=1800) for _ in procs)}
    for p in procs:
        p.join(60)
    return got


def table(path: Path, dtype: str, args) -> str:
    torch.set_num_threads(1)
    one = load_model(str(path), dtype=dtype, device="cpu")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine = Engine(one.model, one.tokenizer, EngineConfig(num_blocks=1024))
    run(engine, prompts(2, args.prompt_len, 99), params)
    expected, baselines = {}, []
    for r in range(2):
        tokens, passes, seconds = run(engine, prompts(args.seqs, args.prompt_len, r), params)
        expected[r] = tokens
        baselines.append((passes, seconds))
    baseline = baselines[0]  # rank 0's prompts, as rank 0 runs them below
    rows = [
        "| run | rank | passes | ms per pass | vote ms per pass | exchanges ms per pass "
        "| empty passes | ms per empty pass | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| one process | - | {baseline[0]} | {baseline[1] / baseline[0] * 1e3:.1f} | | | | | |",
    ]
    runs = (("2 ranks, both busy", (True, True)), ("2 ranks, rank 1 idle", (True, False)))
    for name, busy in runs:
        log(name)
        for r, (tokens, passes, seconds, shown) in sorted(ranks(path, dtype, args, busy).items()):
            n = max(shown["passes"], 1)
            empty = shown["empty_passes"]
            per_empty = f"{shown['empty_pass_ms'] / empty:.1f}" if empty else ""
            per_pass = f"{seconds / passes * 1e3:.1f}" if passes else ""
            same = tokens == expected[r] if busy[r] else ""
            rows.append(
                f"| {name} | {r} | {shown['passes']} | {per_pass} | {shown['vote_ms'] / n:.2f} | "
                f"{shown['exchange_ms'] / n:.1f} | {empty} | {per_empty} | {same} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="a MoE checkpoint (default: bench.deepseek's)")
    args = parser.parse_args(argv)
    path = args.model or checkpoint()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.dtype}, {args.seqs} prompts of {args.prompt_len} tokens per busy rank, "
          f"{args.max_tokens} tokens each\n")  # fmt: skip
    print(table(path, args.dtype, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
