"""`--quantization int8` against the compute dtype: held-out perplexity and speed in one table.

    python -m bench.quantization [--dtypes bfloat16,float32] [--tokens 16384] [--out FILE]

Held-out text: the topic texts of the Python reference that ship with every CPython
(`pydoc_data.topics`), in sorted order, the first `--tokens` tokens, scored in windows of
`--window` tokens each from an empty cache (every token but a window's first is predicted).
int8 calibrates on services/model/loading/calibration.txt, which shares nothing with it.
Speed: a prefill of one 512-token prompt, and decode at batch 1 and 32 (bench/forward.py's
measurements), tokens per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass

import torch

from bench.forward import best_of, ours_decode_seconds, ours_prefill, prompts
from bench.serving import cpu
from services.model.batch import ForwardBatch, SeqChunk
from services.model.causal_lm import CausalLM
from services.model.loader import load_model

BLOCK = 16


@dataclass(frozen=True)
class Row:
    dtype: str
    quantization: str
    perplexity: float
    prefill: float  # tokens/s, one 512-token prompt
    decode_1: float  # tokens/s at batch 1
    decode_32: float  # tokens/s at batch 32


def held_out_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def perplexity(model: CausalLM, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) of every token but each window's first."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start : start + window]
        kv = model.new_kv_cache(-(-window // BLOCK), BLOCK)
        batch = ForwardBatch.build([SeqChunk(chunk, 0, list(range(kv.num_blocks)))], BLOCK)
        batch = dataclasses.replace(batch, logits_rows=torch.arange(window))
        logp = torch.log_softmax(model.forward(batch, kv)[:-1], dim=-1)
        targets = torch.tensor(chunk[1:])[:, None]
        nll -= float(logp.gather(1, targets).sum())
        count += window - 1
    return math.exp(nll / count)


def measure(dtype: str, quantization: str, args: argparse.Namespace) -> Row:
    loaded = load_model(args.model, dtype=dtype, device="cpu", quantization=quantization)
    model = loaded.model
    ids = loaded.tokenizer.encode(held_out_text(), add_special_tokens=False)[: args.tokens]
    ppl = perplexity(model, ids, args.window)
    prefill = 512 / best_of(args.repeats, ours_prefill(model, prompts(1, 512)))
    decode = []
    for b in (1, 32):
        seconds = min(ours_decode_seconds(model, prompts(b, 128, seed=b), 32) for _ in range(2))
        decode.append(b * 32 / seconds)
    return Row(dtype, quantization, ppl, prefill, decode[0], decode[1])


def _cell(value: float, reference: float, is_reference: bool, digits: int = 0) -> str:
    text = f"{value:,.{digits}f}"
    return text if is_reference else f"{text} ({value / reference:.2f}x)"


def markdown(rows: list[Row]) -> str:
    lines = [
        "| dtype | quantization | perplexity | vs unquantized | prefill 512 tok/s "
        "| decode b=1 tok/s | decode b=32 tok/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = {r.dtype: r for r in rows if r.quantization == "none"}
    for r in rows:
        b = base.get(r.dtype, r)
        change = "" if r is b else f"{(r.perplexity / b.perplexity - 1) * 100:+.2f}%"
        lines.append(
            f"| {r.dtype} | {r.quantization} | {r.perplexity:.4f} | {change} | "
            f"{_cell(r.prefill, b.prefill, r is b)} | {_cell(r.decode_1, b.decode_1, r is b, 1)} "
            f"| {_cell(r.decode_32, b.decode_32, r is b)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--quantizations", default="none,int8")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens scored")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    rows = []
    for dtype in args.dtypes.split(","):
        for quantization in args.quantizations.split(","):
            start = time.perf_counter()
            rows.append(measure(dtype, quantization, args))
            r = rows[-1]
            print(
                f"{dtype} {quantization}: perplexity {r.perplexity:.4f}, prefill "
                f"{r.prefill:.0f} tok/s, decode {r.decode_1:.1f} / {r.decode_32:.0f} tok/s "
                f"({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    table = markdown(rows)
    head = f"{cpu()}, {torch.get_num_threads()} threads"
    print(f"{head}\n\n{table}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"{head}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
