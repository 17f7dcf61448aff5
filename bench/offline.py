"""Offline throughput of the engine against transformers' batched generate, in one run.

    python -m bench.offline [--num-prompts 256] [--dtype auto] [--hf-batch 64]

Workload: `--num-prompts` random-token prompts of `--min-len`..`--max-len` tokens (uniform),
`--output-len` new tokens each with ignore_eos, so both sides generate exactly the same
number of tokens. The engine gets every request at once (continuous batching, chunked
prefill). transformers gets the prompts sorted by length (least padding) in batches of
`--hf-batch`, left-padded, greedy, min_new_tokens = max_new_tokens.

Also reported: where the engine's step time goes, and its Python overhead (scheduling,
batch building, sampling, detokenisation) as a share of step time with 32 sequences decoding.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.model.loader import DTYPES, load_model


@dataclass
class Result:
    system: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    faults_per_step: float = 0.0  # minor page faults (services/model/allocator.py)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(100, 49000, (k,), generator=gen).tolist() for k in lengths]


def run_engine(engine: Engine, prompts: list[list[int]], output_len: int) -> Result:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, params))
    start = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    done = 0
    while engine.has_unfinished:
        done += sum(d.finished for d in engine.step())
        if engine.times.steps % 50 == 0:
            log(f"  engine: {done}/{len(prompts)} requests done, step {engine.times.steps}")
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return Result(
        "pdserve",
        seconds,
        sum(map(len, prompts)),
        output_len * len(prompts),
        faults / max(engine.times.steps, 1),
    )


def decode_overhead(engine: Engine, batch: int, steps: int) -> dict[str, float]:
    """Step-time breakdown with `batch` sequences all decoding."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i, p in enumerate(workload(batch, 128, 128, seed=1)):
        engine.add_request(EngineRequest(f"d{i}", p, params))
    while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.times = type(engine.times)()
    for _ in range(steps):
        engine.step()
    t = engine.times
    for rid in list(engine.requests):
        engine.abort(rid)
    ms = 1000 / t.steps
    return {
        "batch": batch,
        "step_ms": (t.schedule + t.forward + t.sample) * ms,
        "schedule_ms": t.schedule * ms,
        "forward_ms": t.forward * ms,
        "sample_ms": t.sample * ms,
        "overhead_share": t.overhead_share,
    }


def run_transformers(
    path: Path, dtype: torch.dtype, prompts: list[list[int]], output_len: int, batch: int
) -> Result:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ordered = sorted(prompts, key=len)
    start = time.perf_counter()
    for i in range(0, len(ordered), batch):
        group = ordered[i : i + batch]
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, p in enumerate(group):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
        log(f"  transformers: {i + len(group)}/{len(ordered)} requests done")
    seconds = time.perf_counter() - start
    return Result("transformers", seconds, sum(map(len, prompts)), output_len * len(prompts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--kv-cache-gb", type=float, default=4.0, help="the engine's KV pool (vLLM CPU's default)"
    )
    p.add_argument("--hf-batch", type=int, default=64, help="transformers' batch size")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    dtype_name = str(loaded.model.dtype).removeprefix("torch.")
    prompts = workload(args.num_prompts, args.min_len, args.max_len)
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gb=args.kv_cache_gb,
    )
    log(f"engine: {len(prompts)} requests, {dtype_name}")
    offline = Engine(loaded.model, loaded.tokenizer, config)
    ours = run_engine(offline, prompts, args.output_len)
    preemptions = offline.scheduler.num_preemptions
    overhead = decode_overhead(offline, batch=32, steps=20)  # the same engine, idle again
    del offline  # its KV pool, before transformers runs
    results = [ours]
    if not args.skip_transformers:
        log(f"transformers: {len(prompts)} requests, batches of {args.hf_batch}")
        results.append(
            run_transformers(
                loaded.path, DTYPES[dtype_name], prompts, args.output_len, args.hf_batch
            )
        )
    print(
        f"dtype {dtype_name}, {len(prompts)} requests, prompts {args.min_len}-{args.max_len}"
        f" tokens, {args.output_len} output tokens each; engine: max {args.max_num_seqs}"
        f" sequences, {args.kv_cache_gb:g} GiB of KV, {preemptions} preemptions"
    )
    print("| system | seconds | output tok/s | total tok/s |")
    print("| --- | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r.system} | {r.seconds:.1f} | {r.output_throughput:.1f} | "
            f"{r.total_throughput:.1f} |"
        )
    if len(results) == 2:
        print(f"ratio (output tok/s): {ours.output_throughput / results[1].output_throughput:.2f}x")
    print(f"engine: {ours.faults_per_step:,.0f} minor page faults a step")
    print(
        f"decode step at batch 32: {overhead['step_ms']:.1f} ms, of which Python "
        f"{overhead['schedule_ms']:.2f} ms scheduling + {overhead['sample_ms']:.2f} ms "
        f"sampling/output = {100 * overhead['overhead_share']:.1f}%"
    )
    if args.json:
        payload = {
            "results": [asdict(r) for r in results],
            "decode_overhead": overhead,
            "preemptions": preemptions,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
