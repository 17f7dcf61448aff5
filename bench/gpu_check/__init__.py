"""A prepared check for a machine with one GPU and no internet: one command, under 8 minutes.

    python -m bench.gpu_check --out DIR [--device cuda|cpu] [--dry] [--budget-s 450]

Sections, each timed and recorded as pass, fail or skip with its numbers (a failure, its
exception text included, stops none of the others), then a markdown table on stdout and
DIR/gpu_check.json. The environment (versions, device, free memory; on a CPU, whether it has
bf16 units) is recorded first.

1. kernel tests (kernel_tests.py): pytest on the Triton kernel tests,
   PDSERVE_TEST_DEVICE=<device> (on a CPU Triton's interpreter runs them). Pass: pytest exits
   0. Skip: no test file there.
2. parity (parity.py): the engine's greedy tokens against transformers'
   `generate(do_sample=False)` on the embedded model, float32 and bfloat16, each prompt alone
   on the transformers side. Pass: float32 identical for every prompt, and bfloat16 identical
   on at least the first min(16, tokens) tokens in more than half the prompts (bfloat16 on a
   GPU rounds differently from transformers' kernels and may legitimately diverge at a near
   tie, late). On a CPU without bf16 units bfloat16 is skipped (torch would emulate it at
   well under 1% of float32's speed); in a dry run it is recorded, not judged (our bf16
   kernels round differently from transformers' on a CPU too, and two prompts of 8 tokens are
   decided by one near tie). A dry run also checks one prompt's first 2 greedy tokens (a
   prefill and a decode forward) through `kernels="triton"` against the default kernels'
   (interpreted on a CPU: 10-15 s the two).
3. throughput (throughput.py): decode tokens/s at each batch (all sequences decoding; prefill
   and warm steps untimed), with async scheduling off and on, and with `--deterministic` off
   (cuBLAS's products instead of the row-invariant GEMM; its prefill too), and the time of
   one prompt's prefill in one chunk, the engine against transformers' `generate` in the
   same run (its decode: time(steps + 1 tokens) - time(1)). On CUDA each engine row says
   how many of its timed steps replayed a CUDA graph (`Engine.graphs.replays`), and the
   engine also runs without graphs at batch 1 and 32, and with `kernels="torch"` when the
   budget allows. Pass: everything measured (the ratios are
   reported, not judged).
4. disaggregated (disaggregated.py): `pdserve up --no-colocated --kv-store local://DIR/kv-*`
   (float32; a fresh store directory under --out, removed after) serves completions, streamed
   and not. The prefill worker writes each prompt's blocks to the store and the decode worker
   reads them: its /metrics (`up --metrics-port`) counts the blocks read and the prompt tokens
   it computed because the store missed. Each text must equal the in-process engine's for
   the same token prompt. TTFT and the stream's decode tok/s are recorded. Pass: every text
   equal, blocks read and no prompt token recomputed by the decode worker, `up` exits 0 on
   SIGINT and no process of the stack is left running.
5. families (families.py): tiny random checkpoints of the MoE and latent-attention families
   (made by the transformers in use) greedy on the device against transformers' there, float32;
   and DeepSeek-V3's and V4's MTP layers drafting (`--speculative mtp`). Pass: every family
   transformers builds identical, the drafted tokens equal the plain engine's, drafts accepted.
6. realistic (realistic.py): a random Llama-3-8B-shaped model and a DeepSeek-V3-shaped MoE of
   two layers (DeepSeek-V3's widths), made on the device: batch-1 decode against the
   memory-bound limit (bytes a step reads over the measured copy bandwidth), batch 64 tok/s,
   and a 4,096-token prefill against transformers'. Pass: everything measured.
7. parallel (parallel.py): a tiny Qwen3-MoE's tensor-parallel and data-parallel ranks over
   NCCL (GPUs 0 and 1) against one process. Pass: tokens equal. Skip: one GPU (said so).

Sizes (check.py): all the kernel tests; parity 8 prompts x 64 tokens; decode at batch 1, 32
and 256 (32-token prompts, 4 warm steps, 64 timed); a 4,096-token prefill; 4 served prompts
x 32 tokens. `--dry`: one kernel test a file, 2 prompts x 8 tokens, decode at 1 and 4
(transformers at 1; 16-token prompts, 1 warm step, 2 timed), a 32-token prefill, 1 served
prompt x 8 tokens, so that the CPU test suite runs every section end to end
(tests/bench/test_gpu_check.py). `--only a,b`: those sections alone.
`--budget-s`: sections not started by then are skipped
("budget"). Exit status 1 when a section failed. docs/gpu.md says how to carry the
dependencies to a machine without internet.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench.gpu_check import (
    disaggregated,
    families,
    kernel_tests,
    parallel,
    parity,
    realistic,
    throughput,
)
from bench.gpu_check.check import DRY, FULL, Check, Skip
from bench.offline import log
from services.model.loader import cpu_has_bf16_units


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass
class Section:
    name: str
    status: Status = Status.SKIP
    seconds: float = 0.0
    reason: str = ""  # why it failed or was skipped
    numbers: dict[str, Any] = field(default_factory=dict)


class Steps(NamedTuple):
    run: Callable[[Check, dict[str, Any]], bool]  # fills the numbers; pass or fail, or Skip
    summary: Callable[[dict[str, Any]], str]  # the numbers in one line of the table


SECTIONS = {
    "kernel_tests": Steps(kernel_tests.run, kernel_tests.summary),
    "parity": Steps(parity.run, parity.summary),
    "throughput": Steps(throughput.run, throughput.summary),
    "disaggregated": Steps(disaggregated.run, disaggregated.summary),
    "families": Steps(families.run, families.summary),
    "realistic": Steps(realistic.run, realistic.summary),
    "parallel": Steps(parallel.run, parallel.summary),
}


def environment(device: torch.device) -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "cuda": torch.version.cuda,
        "device": str(device),
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        env |= {"device_name": torch.cuda.get_device_name(device),
                "free_memory_gib": free / 2**30, "total_memory_gib": total / 2**30}  # fmt: skip
    else:
        from bench.serving import cpu

        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        env |= {"device_name": cpu(), "free_memory_gib": pages / 2**30,
                "bf16_units": cpu_has_bf16_units()}  # fmt: skip
    return env


def run_section(check: Check, name: str) -> Section:
    section = Section(name)
    if check.left() <= 0:
        section.reason = "budget"
        return section
    log(f"{name}: starting ({check.left():.0f}s of the budget left)")
    start = time.perf_counter()
    try:
        passed = SECTIONS[name].run(check, section.numbers)
        section.status = Status.PASS if passed else Status.FAIL
    except Skip as e:
        section.reason = str(e)
    except Exception as e:  # recorded; the next section runs
        section.status, section.reason = Status.FAIL, f"{type(e).__name__}: {e}"
        section.numbers["traceback"] = traceback.format_exc()
    section.seconds = time.perf_counter() - start
    gc.collect()
    if check.device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"{name}: {section.status} in {section.seconds:.1f}s {section.reason}")
    return section


def summary(s: Section) -> str:
    """One line of a section's numbers, or "" where a failure left them incomplete."""
    try:
        return SECTIONS[s.name].summary(s.numbers)
    except (KeyError, TypeError, ZeroDivisionError):
        return ""


def table(env: dict[str, Any], sections: list[Section]) -> str:
    lines = [f"{env['device_name']} ({env['device']}); torch {env['torch']}, triton "
             f"{env['triton']}, transformers {env['transformers']}, CUDA {env['cuda']}, "
             f"{env['free_memory_gib']:.1f} GiB free", "",
             "| section | status | seconds | numbers |", "| --- | --- | ---: | --- |"]  # fmt: skip
    for s in sections:
        text = summary(s) or s.reason
        if s.reason and text != s.reason:
            text += f" ({s.reason})"
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.1f} | {text.replace('|', '/')} |")
    rows = next((s.numbers.get("decode") for s in sections if s.name == "throughput"), None)
    if rows:
        lines += ["", *throughput.decode_table(rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="writes gpu_check.json here")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--dry", action="store_true", help="tiny shapes (the CPU test suite's run)")
    p.add_argument("--budget-s", type=float, default=450, help="no section starts after this")
    p.add_argument(
        "--only",
        type=lambda v: v.split(","),
        default=list(SECTIONS),
        help=f"sections to run, comma-separated (of {','.join(SECTIONS)})",
    )
    args = p.parse_args(argv)
    if unknown := set(args.only) - set(SECTIONS):
        p.error(f"--only: no section {', '.join(sorted(unknown))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    device = torch.device(args.device)
    check = Check(device, DRY if args.dry else FULL, args.dry, started + args.budget_s, args.out)
    env = environment(device)
    log(f"environment: {json.dumps(env)}")
    sections = [run_section(check, name) for name in SECTIONS if name in args.only]
    total = time.monotonic() - started
    result = {"mode": "dry" if args.dry else "full", "budget_s": args.budget_s,
              "seconds": total, "environment": env,
              "sections": {s.name: dataclasses.asdict(s) for s in sections}}  # fmt: skip
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    print(table(env, sections))
    print(f"\n{total:.0f}s in all; wrote {args.out / 'gpu_check.json'}")
    return 1 if any(s.status is Status.FAIL for s in sections) else 0
