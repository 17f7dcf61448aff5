"""Forward-pass throughput of pdserve's model runtime against transformers, in one run.

    python -m bench.forward [--dtypes float32,bfloat16] [--batches 1,8,32,64] [--plot out.png]

For each dtype the CPU runs well: a prefill of one `--prompt-len` prompt, then decode at each
batch size (`--context` prompt tokens per sequence, `--steps` new tokens). transformers does
the same work on the same weights: one forward over the prompt, and batched `generate`, whose
decode time is generate(steps + 1 tokens) - generate(1 token). Figures go to stdout as a
Markdown table, with ours / transformers ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from services.model.batch import ForwardBatch, SeqChunk
from services.model.causal_lm import CausalLM
from services.model.loader import DTYPES, cpu_has_bf16_units, load_model

BLOCK = 16


@dataclass(frozen=True)
class Row:
    dtype: str
    work: str  # "prefill 512" or "decode b=32"
    ours: float  # tokens/s
    transformers: float  # tokens/s

    @property
    def ratio(self) -> float:
        return self.ours / self.transformers

    def __str__(self) -> str:
        return (
            f"{self.dtype} {self.work}: pdserve {self.ours:.0f} tok/s, "
            f"transformers {self.transformers:.0f} tok/s ({self.ratio:.2f}x)"
        )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    """Median wall time of `repeats` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompts(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49000, (batch, length), generator=gen)


def ours_prefill(model: CausalLM, ids: torch.Tensor) -> Callable[[], object]:
    n = ids.shape[1]
    kv = model.new_kv_cache(-(-n // BLOCK), BLOCK)
    batch = ForwardBatch.build([SeqChunk(ids[0].tolist(), 0, list(range(kv.num_blocks)))], BLOCK)
    return lambda: model.forward(batch, kv)


def ours_decode_seconds(model: CausalLM, ids: torch.Tensor, steps: int) -> float:
    """Time of `steps` decode passes over the whole batch, after prefilling it."""
    b, n = ids.shape
    per_seq = -(-(n + steps) // BLOCK)
    kv = model.new_kv_cache(b * per_seq, BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
    chunks = [SeqChunk(ids[i].tolist(), 0, tables[i]) for i in range(b)]
    next_ids = model.forward(ForwardBatch.build(chunks, BLOCK), kv).argmax(-1).tolist()
    start = time.perf_counter()
    for step in range(steps):
        chunks = [SeqChunk([next_ids[i]], n + step, tables[i]) for i in range(b)]
        next_ids = model.forward(ForwardBatch.build(chunks, BLOCK), kv).argmax(-1).tolist()
    return time.perf_counter() - start


def hf_generate(model: Any, ids: torch.Tensor, new: int) -> Callable[[], object]:
    def run() -> object:
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )

    return run


def bench_dtype(dtype: str, args: argparse.Namespace) -> list[Row]:
    import transformers

    loaded = load_model(args.model, dtype=dtype, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=DTYPES[dtype])
    hf.eval()
    rows = []
    ids = prompts(1, args.prompt_len)
    ours = best_of(args.repeats, ours_prefill(loaded.model, ids))

    def hf_forward() -> object:
        with torch.inference_mode():
            return hf(ids)

    theirs = best_of(args.repeats, hf_forward)
    rows.append(
        Row(dtype, f"prefill {args.prompt_len}", args.prompt_len / ours, args.prompt_len / theirs)
    )
    log(str(rows[-1]))
    for b in args.batches:
        ids = prompts(b, args.context, seed=b)
        ours_s = min(ours_decode_seconds(loaded.model, ids, args.steps) for _ in range(2))
        first, full = 0.0, 0.0
        for _ in range(5):  # on a noisy machine a few steps can time under the prefill alone
            first = best_of(1, hf_generate(hf, ids, 1))
            full = best_of(1, hf_generate(hf, ids, args.steps + 1))
            if full > first:
                break
        rows.append(
            Row(dtype, f"decode b={b}", b * args.steps / ours_s, b * args.steps / (full - first))
        )
        log(str(rows[-1]))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| dtype | work | pdserve tok/s | transformers tok/s | ratio |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r.dtype} | {r.work} | {r.ours:.1f} | {r.transformers:.1f} | {r.ratio:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for dtype, style in zip(dict.fromkeys(r.dtype for r in rows), ("-", ":"), strict=False):
        decode = [r for r in rows if r.dtype == dtype and r.work.startswith("decode")]
        batches = [int(r.work.split("=")[1]) for r in decode]
        ax.plot(
            batches, [r.ours for r in decode], "o" + style, color="C0", label=f"pdserve {dtype}"
        )
        theirs = [r.transformers for r in decode]
        ax.plot(batches, theirs, "s" + style, color="C1", label=f"transformers {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode throughput, SmolLM2-135M, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    default_dtypes = "float32,bfloat16" if cpu_has_bf16_units() else "float32"
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtypes", default=default_dtypes, help="comma-separated")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per decoding sequence")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of decode throughput vs batch size")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    rows = [r for d in args.dtypes.split(",") for r in bench_dtype(d, args)]
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"ratio": r.ratio} for r in rows], indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
