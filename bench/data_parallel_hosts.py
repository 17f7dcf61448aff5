"""Data-parallel ranks on two hosts: step time against DP size and link rate, on the multi-host
bed (tests/support/netbed.py; needs root and iproute2).

    python -m bench.data_parallel_hosts [--sizes 2,4] [--rates none,1,0.1] [--delay-ms 0]
        [--dtype float32] [--seqs 4] [--prompt-len 32] [--max-tokens 16] [--model DIR]

Two bed hosts, h0 and h1, each on a link shaped to the rate (Gbit/s each way; `none`: the
veth's own speed) with `--delay-ms` added (netem, where the kernel has it): rank r of N runs
on h(r mod 2), so every exchange crosses the links except between ranks on one host. Every
rank is busy (its own `--seqs` random prompts, greedy; one thread), on bench.deepseek's
DeepSeek-V3-shaped checkpoint (7 MoE layers of 32 routed experts, 4 active per token) unless
--model names another MoE checkpoint. Per size and rate, one Markdown row: ms per pass, the
exchanges' ms per pass (dispatch, the received rows computed, combine: all of a MoE layer
after routing) and their share, the vote's, and the bytes each rank sent per pass, measured
(services/model/parallel/data.py counts them) beside the arithmetic

    tokens x top_k x (N - 1) / N x hidden x bytes x 2 (there and back) x MoE layers

(the choices bound for another rank's experts, when routing spreads evenly). Every rank's
tokens are checked against one process's for the same prompts. On 2 cores, 4 ranks share
2 cores: the 4-rank rows show the exchange's bytes, not its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.data_parallel import prompts, run
from bench.deepseek import checkpoint, log
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.launcher import free_port
from services.model.loader import load_model
from services.model.loading.hf_config import read_config
from services.model.parallel import data
from tests.support.netbed import Bed, Link, unavailable

HOSTS = ["h0", "h1"]


def rank_main(args: argparse.Namespace) -> None:
    """One rank (run on a bed host): its prompts' tokens and its share of the agreement's
    cost, as one JSON line on stdout."""
    torch.set_num_threads(1)
    loaded = load_model(str(args.model), dtype=args.dtype, device="cpu")
    lockstep = data.join(loaded.model, data.Grid(args.rank, args.ranks, args.address))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=1024))
    run(engine, prompts(2, args.prompt_len, 99), params, lockstep)  # every rank warms up
    while lockstep.idle():
        pass
    before = lockstep.snapshot()
    tokens, passes, seconds = run(
        engine, prompts(args.seqs, args.prompt_len, args.rank), params, lockstep
    )
    while lockstep.idle():  # the others' last passes
        pass
    after = lockstep.snapshot()
    since = {k: v - before[k] for k, v in after.items() if isinstance(v, int | float)}
    print(json.dumps({"tokens": tokens, "passes": passes, "seconds": seconds, **since}))
    lockstep.leave()
    sys.stdout.flush()
    os._exit(0)  # no teardown: a process holding groups made directly has aborted in it


def ranks(bed: Bed, args: argparse.Namespace, size: int) -> list[dict]:
    """Every rank's report, rank r on HOSTS[r % 2]."""
    address = f"{bed.address(HOSTS[0])}:{free_port()}"
    common = [
        sys.executable, "-m", "bench.data_parallel_hosts", "--ranks", str(size), "--address",
        address, "--model", str(args.model), "--dtype", args.dtype, "--seqs", str(args.seqs),
        "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*bed.exec(HOSTS[r % 2]), *common, "--rank", str(r)], stdout=subprocess.PIPE, text=True
        )
        for r in range(size)
    ]
    reports = []
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"rank {r} of {size} exited {p.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def expected_tokens(args: argparse.Namespace, size: int) -> list[list[list[int]]]:
    """One process's tokens for each rank's prompts."""
    torch.set_num_threads(1)
    one = load_model(str(args.model), dtype=args.dtype, device="cpu")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine = Engine(one.model, one.tokenizer, EngineConfig(num_blocks=1024))
    return [run(engine, prompts(args.seqs, args.prompt_len, r), params)[0] for r in range(size)]


def arithmetic_bytes(args: argparse.Namespace, size: int, passes: int) -> float:
    """Bytes a rank sends per pass by the formula of the module's docstring."""
    c = read_config(args.model)
    assert c.moe is not None
    tokens = args.seqs * (args.prompt_len + args.max_tokens)  # every token once, over passes
    per_token = c.moe.top_k * (size - 1) / size * c.hidden_size * 2 * len(c.moe.layers)
    return tokens * per_token * torch.finfo(getattr(torch, args.dtype)).bits / 8 / passes


def table(args: argparse.Namespace) -> str:
    sizes = [int(s) for s in args.sizes.split(",")]
    rates = [None if r == "none" else float(r) * 1e9 for r in args.rates.split(",")]
    log("one process's tokens")
    expected = expected_tokens(args, max(sizes))
    rows = [
        "| DP size | link (Gbit/s) | ms per pass | exchanges ms per pass | exchanges' share "
        "| vote ms per pass | sent MB per pass (measured) | sent MB per pass (arithmetic) "
        "| same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    with Bed(HOSTS) as bed:
        for rate in rates:
            for host in HOSTS:
                bed.shape(host, Link(rate_bit=rate, delay_ms=args.delay_ms))
            for size in sizes:
                log(f"{size} ranks, link {rate or 'unshaped'}")
                start = time.perf_counter()
                got = ranks(bed, args, size)
                log(f"  {time.perf_counter() - start:.0f} s")
                passes = max(g["passes"] for g in got)
                ms = sum(g["seconds"] / max(g["passes"], 1) for g in got) / size * 1e3
                exchange = sum(g["exchange_ms"] / max(g["passes"], 1) for g in got) / size
                vote = sum(g["vote_ms"] / max(g["passes"], 1) for g in got) / size
                sent = sum(g["sent_bytes"] / max(g["passes"], 1) for g in got) / size
                same = all(g["tokens"] == expected[r] for r, g in enumerate(got))
                rows.append(
                    f"| {size} | {'veth' if rate is None else f'{rate / 1e9:g}'} | {ms:.1f} | "
                    f"{exchange:.1f} | {exchange / ms:.0%} | {vote:.2f} | {sent / 1e6:.2f} | "
                    f"{arithmetic_bytes(args, size, passes) / 1e6:.2f} | {same} |"
                )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--rates", default="none,1,0.1", help="Gbit/s each way; none: unshaped")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", type=Path, help="a MoE checkpoint (default: bench.deepseek's)")
    # one rank's own (the table's runs start them on the bed's hosts)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model or checkpoint()
    if args.rank is not None:
        rank_main(args)
        return 0
    why = unavailable()
    if why is not None:
        print(f"bench.data_parallel_hosts: {why}", file=sys.stderr)
        return 2
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.dtype}, {args.seqs} prompts of {args.prompt_len} tokens per rank, "
          f"{args.max_tokens} tokens each, {args.delay_ms} ms added per link\n")  # fmt: skip
    print(table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
