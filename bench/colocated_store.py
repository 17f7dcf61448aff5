"""The KV store in the colocated path: a conversation's next turn on another decode worker,
its prefix imported from the store, against the same-length prompt computed there.

    python -m bench.colocated_store [--lengths 512,1024,2048] [--repeats 3] [--store URL]

Two decode workers (the embedded model, auto dtype) on one store (a fresh local:// directory
by default). Per length: the first turn (a random prompt of that length, 8 tokens) on worker
A; its next turn (the same prompt, the answer and 32 new tokens) on worker B, which imports
the first turn's blocks; and a new prompt of the next turn's length on B, computed whole.
TTFT is the time to the first Decode chunk, the median of `--repeats` conversations. Every
request is greedy with `local_prefill` (no prefill worker ran), as the colocated stack sends
it. A Markdown table: TTFT imported and computed, their ratio, the blocks imported.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from services.engine.params import SamplingParams
from services.launcher import WorkerProcess
from services.model.loading.sources import EMBEDDED, resolve
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.worker.convert import to_proto_params

PARAMS = to_proto_params(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def turn(address: str, rid: str, ids: list[int]) -> tuple[float, list[int], int]:
    """TTFT in seconds, the tokens, and the store hits the request added."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.DecodeWorkerStub(channel)
        hits = (await stub.Load(pb.LoadRequest())).store_hits
        request = pb.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, params=PARAMS, seed=1, local_prefill=True
        )
        start, ttft, tokens = time.perf_counter(), 0.0, []
        async for chunk in stub.Decode(request):
            ttft = ttft or time.perf_counter() - start
            tokens += chunk.token_ids
        return ttft, tokens, (await stub.Load(pb.LoadRequest())).store_hits - hits


async def measure(a: str, b: str, length: int, repeats: int) -> dict[str, float]:
    imported, computed, blocks = [], [], []
    for r in range(repeats):
        first = random_prompt(length, seed=1000 * length + r)
        _, answer, _ = await turn(a, f"first-{length}-{r}", first)
        await asyncio.sleep(0.5)  # the first turn's blocks written back
        following = first + answer + random_prompt(32, seed=7 + r)
        ttft, _, hits = await turn(b, f"next-{length}-{r}", following)
        imported.append(ttft)
        blocks.append(hits)
        fresh = random_prompt(len(following), seed=5000 * length + r)
        computed.append((await turn(b, f"fresh-{length}-{r}", fresh))[0])
    return {"imported": statistics.median(imported), "computed": statistics.median(computed),
            "blocks": statistics.median(blocks)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--store", default=None, help="KV store URL (default: a fresh local://)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or f"local://{Path(tmp) / 'kv'}"
        model = str(resolve(EMBEDDED))
        workers = [
            WorkerProcess("decode", model, store, Path(tmp), "--num-blocks", "1024")
            for _ in range(2)
        ]  # the default dtype (auto)
        for w in workers:
            w.launch()
        try:
            for w in workers:
                w.wait_ready()
            a, b = (w.address for w in workers)
            print(f"{platform.processor() or platform.machine()}, store {store.split('://')[0]}")
            print(
                "| prompt tokens | TTFT imported ms | TTFT computed ms | computed / imported "
                "| blocks imported |\n| --- | --- | --- | --- | --- |"
            )
            for length in (int(n) for n in args.lengths.split(",")):
                m = asyncio.run(measure(a, b, length, args.repeats))
                print(
                    f"| {length + 8 + 32} | {1000 * m['imported']:.1f} | "
                    f"{1000 * m['computed']:.1f} | {m['computed'] / m['imported']:.2f}x | "
                    f"{m['blocks']:.0f} |",
                    flush=True,
                )
        finally:
            for w in workers:
                w.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
