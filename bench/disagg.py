"""The KV handoff under load: does fetching a long prompt's KV stall running streams, and what
does a prefix hit in the store save?

    python -m bench.disagg [--streams 16] [--prompt-len 2000] [--plot stall.png]

Starts a redis-server, two prefill workers and a decode worker (the CPU's dtype), then:

1. Stall: `--streams` requests decode on the decode worker (short prompts, computed there).
   While they stream, a request whose `--prompt-len`-token prompt was prefilled earlier joins:
   its KV is fetched from the store and imported. Reported: the running streams' median gap
   between tokens before it joined, and their longest gap from its Decode call until its
   first token (goal: at most 2x the median).
2. TTFT: on the second prefill worker (its own cache empty), Prefill of a fresh
   `--prompt-len`-token prompt (nothing cached), against one whose first 90% was prefilled
   by the first worker (found in the store). Median of `--repeats` (goal: at most 20%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import torch

from services.engine.params import SamplingParams
from services.launcher import WorkerProcess, start_redis
from services.model.loading import sources
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class StallResult:
    median_gap_ms: float = 0.0
    max_gap_during_fetch_ms: float = 0.0
    fetch_to_first_token_ms: float = 0.0
    timeline: list[tuple[int, float]] = field(default_factory=list)  # (stream, arrival time)
    joined_at: float = 0.0
    first_token_at: float = 0.0

    @property
    def ratio(self) -> float:
        return self.max_gap_during_fetch_ms / self.median_gap_ms


async def stream(
    stub: pbg.DecodeWorkerStub,
    request: pb.DecodeRequest,
    index: int,
    arrivals: list[tuple[int, float]],
) -> None:
    async for chunk in stub.Decode(request):
        if chunk.token_ids:
            arrivals.append((index, time.perf_counter()))


async def measure_stall(prefill: str, decode: str, args: argparse.Namespace) -> StallResult:
    long_prompt = tokens(args.prompt_len, seed=1)
    greedy = to_proto_params(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    async with grpc.aio.insecure_channel(prefill) as pch, grpc.aio.insecure_channel(decode) as dch:
        p, d = pbg.PrefillWorkerStub(pch), pbg.DecodeWorkerStub(dch)
        reply = await p.Prefill(
            pb.PrefillRequest(
                request_id="long", prompt_token_ids=long_prompt, params=greedy, seed=1
            )
        )
        log(f"prefilled the {args.prompt_len}-token prompt ({reply.computed_tokens} computed)")
        running = to_proto_params(
            SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True)
        )
        arrivals: list[tuple[int, float]] = []
        tasks = [
            asyncio.create_task(
                stream(
                    d,
                    pb.DecodeRequest(
                        request_id=f"s{i}",
                        prompt_token_ids=tokens(32, seed=100 + i),
                        params=running,
                        seed=i,
                        local_prefill=True,
                    ),
                    i,
                    arrivals,
                )
            )
            for i in range(args.streams)
        ]
        await asyncio.sleep(args.warmup)  # all streams prefilled and decoding steadily
        joined = time.perf_counter()
        join = d.Decode(
            pb.DecodeRequest(
                request_id="joiner",
                prompt_token_ids=long_prompt,
                output_token_ids=[reply.first_token],
                params=greedy,
                seed=1,
            )
        )
        first = await join.read()
        first_at = time.perf_counter()
        assert first is not grpc.aio.EOF and first.token_ids
        await asyncio.sleep(1.0)
        for task in tasks:
            task.cancel()
        join.cancel()
    before, during = [], []
    last: dict[int, float] = {}
    for i, t in sorted(arrivals, key=lambda a: a[1]):
        if i in last:
            gap = t - last[i]
            if joined - 3.0 <= last[i] and t < joined:
                before.append(gap)
            elif t > joined and last[i] < first_at:  # a gap overlapping the fetch and import
                during.append(gap)
        last[i] = t
    if not before or not during:
        raise SystemExit(
            "the streams ended before the prompt joined: raise --stream-tokens or lower --warmup"
        )
    return StallResult(
        median_gap_ms=1000 * statistics.median(before),
        max_gap_during_fetch_ms=1000 * max(during),
        fetch_to_first_token_ms=1000 * (first_at - joined),
        timeline=arrivals,
        joined_at=joined,
        first_token_at=first_at,
    )


async def measure_ttft(writer: str, reader: str, args: argparse.Namespace) -> dict[str, float]:
    greedy = to_proto_params(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    shared = int(args.prompt_len * 0.9)

    def request(rid: str, ids: list[int]) -> pb.PrefillRequest:
        return pb.PrefillRequest(request_id=rid, prompt_token_ids=ids, params=greedy, seed=1)

    async with grpc.aio.insecure_channel(writer) as wch, grpc.aio.insecure_channel(reader) as rch:
        w, r = pbg.PrefillWorkerStub(wch), pbg.PrefillWorkerStub(rch)
        await r.Prefill(request("warm", tokens(64, 2)))
        cold, hit = [], []
        for k in range(args.repeats):
            prefix = tokens(shared, seed=1000 + k)
            await w.Prefill(request(f"w{k}", prefix + tokens(50, 2000 + k)))  # into the store
            start = time.perf_counter()
            await r.Prefill(request(f"c{k}", tokens(args.prompt_len, seed=3000 + k)))
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            again = prefix + tokens(args.prompt_len - shared, seed=4000 + k)
            reply = await r.Prefill(request(f"h{k}", again))
            hit.append(time.perf_counter() - start)
            log(
                f"ttft {k}: uncached {cold[-1] * 1000:.0f} ms, 90% in the store "
                f"{hit[-1] * 1000:.0f} ms ({reply.cached_tokens} tokens cached)"
            )
    return {"uncached_ms": 1000 * statistics.median(cold), "hit_ms": 1000 * statistics.median(hit)}


def plot(result: StallResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last: dict[int, float] = {}
    xs, ys = [], []
    for i, t in sorted(result.timeline, key=lambda a: a[1]):
        if i in last:
            xs.append(t - result.joined_at)
            ys.append(1000 * (t - last[i]))
        last[i] = t
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.scatter(xs, ys, s=4, alpha=0.6, label="gap between tokens, per running stream")
    ax.axvspan(
        0,
        result.first_token_at - result.joined_at,
        color="C1",
        alpha=0.2,
        label="long prompt's KV fetched and imported",
    )
    ax.axhline(result.median_gap_ms, color="gray", lw=1, ls="--", label="median gap before")
    ax.set_xlim(-3, 1)
    ax.set_xlabel("seconds from the joining request's Decode call")
    ax.set_ylabel("inter-token gap (ms)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--stream-tokens", type=int, default=2000, help="max_tokens of the streams")
    p.add_argument("--warmup", type=float, default=6.0, help="seconds of streaming before")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-disagg-"))
    redis, url = start_redis(work / "redis")
    model = str(sources.resolve(args.model))
    common = ("--num-blocks", "600")
    procs = [
        WorkerProcess("prefill", model, url, work, *common, dtype=args.dtype),
        WorkerProcess("prefill", model, url, work, *common, dtype=args.dtype),
        WorkerProcess("decode", model, url, work, *common, dtype=args.dtype),
    ]
    try:
        for proc in procs:
            proc.start()
        log("workers ready")
        stall = asyncio.run(measure_stall(procs[0].address, procs[2].address, args))
        ttft = asyncio.run(measure_ttft(procs[0].address, procs[1].address, args))
    finally:
        for proc in procs:
            proc.stop()
        redis.terminate()
    print(
        f"{args.streams} streams decoding; a {args.prompt_len}-token prompt's KV fetched meanwhile"
    )
    print("| measure | value |")
    print("| --- | ---: |")
    print(f"| median gap between tokens before (ms) | {stall.median_gap_ms:.1f} |")
    print(f"| longest gap while the KV was fetched (ms) | {stall.max_gap_during_fetch_ms:.1f} |")
    print(f"| ratio (goal <= 2x) | {stall.ratio:.2f}x |")
    print(f"| Decode call to the joiner's first token (ms) | {stall.fetch_to_first_token_ms:.0f} |")
    share = ttft["hit_ms"] / ttft["uncached_ms"]
    print(f"| TTFT, {args.prompt_len} tokens, nothing cached (ms) | {ttft['uncached_ms']:.0f} |")
    print(f"| TTFT, 90% of it in the store (ms) | {ttft['hit_ms']:.0f} |")
    print(f"| share (goal <= 20%) | {100 * share:.1f}% |")
    if args.json:
        out = {"stall": {k: v for k, v in asdict(stall).items() if k != "timeline"}, "ttft": ttft}
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot:
        plot(stall, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
