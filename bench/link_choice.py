"""Fetch or compute a prompt's KV, across link rates: on the multi-host bed
(tests/support/netbed.py; needs root and iproute2).

    python -m bench.link_choice [--rates 10,1,0.1] [--delays 0] \\
        [--lengths 256,1024,2048,4096,8000] [--json F] [--plot F]

Hosts: Redis; a writer decode worker (the default dtype, auto) that computes each prompt and
writes its blocks back; three readers of the same kind on links shaped to the rate, with
`--kv-fetch always` (fetch), `never` (compute) and `auto` (the measured choice); and an fp8
pair (`--kv-store-dtype fp8`: a writer, and a reader that always fetches). The writers' and
Redis's links are not shaped, so a reader's link is the bottleneck. Delays need the kernel's
netem qdisc (the bed says when it has none).

Per rate (fastest first) the auto reader is warmed as traffic would warm it: a 1024-token
prompt it computes (the prompt rate) and one it reads (the link). Then per length, fresh random
prompts written by both writers, and the readers' TTFT (time to the first Decode chunk,
local_prefill, greedy, 1 token): the median of --repeats prompts, the readers asked in turn,
each first once, each when the one before is done (every worker and Redis idle: a reader that
computed a prompt writes its blocks back after its first token). Every reader computes or
reads the whole prompt: its own cache has never seen it. A Markdown table per rate and, with
--plot, TTFT against prompt length, one panel per link.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import grpc
import redis
import torch

from services.engine.params import SamplingParams
from services.model.loading.sources import EMBEDDED, resolve
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.settings import DEFAULTS
from services.worker.convert import to_proto_params
from tests.support.bed_stack import BedRedis, BedWorker
from tests.support.cluster import log_events
from tests.support.netbed import Bed, Link, unavailable

PARAMS = to_proto_params(SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
# readers write nothing back: each request's link and cores are its own
READERS = {"fetch": ["--kv-fetch", "always"], "compute": ["--kv-fetch", "never"],
           "auto": ["--kv-fetch", "auto"],
           "fp8": ["--kv-fetch", "always", "--kv-store-dtype", "fp8"]}  # fmt: skip
READER_ARGS = ["--no-write-back"]
WRITERS = {"writer": [], "writer_fp8": ["--kv-store-dtype", "fp8"]}
BLOCK = 16


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def ttft(address: str, rid: str, ids: list[int]) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        request = pb.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, params=PARAMS, seed=1, local_prefill=True
        )
        start = time.perf_counter()
        async for _ in pbg.DecodeWorkerStub(channel).Decode(request, timeout=600):
            return time.perf_counter() - start
    raise RuntimeError("no chunk")


def write(writer: BedWorker, store: redis.Redis, rid: str, ids: list[int]) -> None:
    """The writer computes the prompt; returns once its blocks are in Redis."""
    before = store.dbsize()
    asyncio.run(ttft(writer.address, rid, ids))
    deadline = time.monotonic() + 120
    while store.dbsize() < before + len(ids) // BLOCK:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{writer.host}: blocks of {rid} not written in 120 s")
        time.sleep(0.05)


def choice_of(reader: BedWorker, rid: str) -> dict[str, str]:
    """The auto reader's choice for the request and the two times it expected."""
    line = next(
        e for e in log_events(reader) if e.get("msg") == "fetched" and e.get("request_id") == rid
    )
    return {k: line.get(k, "?") for k in ("choice", "expected_fetch_ms", "expected_compute_ms")}


def cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def settle(workers: dict[str, BedWorker], store: redis.Redis, timeout: float = 60) -> None:
    """Wait until the workers and Redis are idle (the last reader's request aborted, its
    write-back done): 0.3 s with under 10% of a core used by them all and no Redis command."""
    pids = [w.process.pid for w in workers.values() if w.process is not None]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cpu, calls = cpu_seconds(pids), store.info("stats")["total_commands_processed"]
        time.sleep(0.3)
        busy = cpu_seconds(pids) - cpu
        if busy < 0.03 and store.info("stats")["total_commands_processed"] == calls + 1:
            return


def measure(
    workers: dict[str, BedWorker], store: redis.Redis, length: int, tag: str, repeats: int
) -> dict[str, Any]:
    """The median TTFT of `repeats` fresh prompts on each reader; the auto reader's choices."""
    times: dict[str, list[float]] = {name: [] for name in READERS}
    choices = []
    for r in range(repeats):
        ids = random_prompt(length, seed=zlib.crc32(f"{tag}-{length}-{r}".encode()))
        for name in WRITERS:
            write(workers[name], store, f"{tag}-{length}-{r}-{name}", ids)
        names = list(READERS)
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each first in turn
            settle(workers, store)  # the one before done (its write-back, its abort)
            rid = f"{tag}-{length}-{r}-{name}"
            times[name].append(asyncio.run(ttft(workers[name].address, rid, ids)))
            if name == "auto":
                choices.append(choice_of(workers[name], rid))
    row: dict[str, Any] = {"tokens": length, "auto_choices": choices, "samples": times}
    row.update({name: statistics.median(t) for name, t in times.items()})
    row["auto_choice"] = "/".join(sorted({c["choice"] for c in choices}))
    return row


def warm(workers: dict[str, BedWorker], store: redis.Redis, tag: str) -> None:
    """The auto reader's rates measured, as its own traffic measures them."""
    auto = workers["auto"].address
    fresh = random_prompt(1024, seed=zlib.crc32(f"{tag}-c".encode()))
    asyncio.run(ttft(auto, f"{tag}-warm-computed", fresh))
    ids = random_prompt(1024, seed=zlib.crc32(f"{tag}-r".encode()))
    write(workers["writer"], store, f"{tag}-warm-w", ids)
    asyncio.run(ttft(auto, f"{tag}-warm-read", ids))


def table(rows: list[dict], title: str) -> str:
    out = [f"**{title}**", "",
           "| prompt tokens | TTFT fetch ms | TTFT compute ms | TTFT auto ms (choice) "
           "| auto / better | TTFT fetch fp8 ms |",
           "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        better = min(r["fetch"], r["compute"])
        out.append(
            f"| {r['tokens']} | {1000 * r['fetch']:.0f} | {1000 * r['compute']:.0f} | "
            f"{1000 * r['auto']:.0f} ({r['auto_choice']}) | {r['auto'] / better:.2f} | "
            f"{1000 * r['fp8']:.0f} |"
        )
    return "\n".join(out)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), sharey=True)
    for ax, result in zip(axes if len(results) > 1 else [axes], results, strict=True):
        rows = result["rows"]
        x = [r["tokens"] for r in rows]
        for name, style in (("fetch", "o-"), ("compute", "s-"), ("auto", "x--"), ("fp8", "^:")):
            ax.plot(x, [r[name] for r in rows], style, label=name)
        ax.set_title(result["link"])
        ax.set_xlabel("prompt tokens")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    (axes[0] if len(results) > 1 else axes).set_ylabel("TTFT (s)")
    (axes[0] if len(results) > 1 else axes).legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="10,1,0.1", help="Gbit/s, fastest first")
    ap.add_argument("--delays", default="0", help="ms each way per link (needs netem)")
    ap.add_argument("--lengths", default="256,1024,2048,4096,8000")
    ap.add_argument("--repeats", type=int, default=3, help="fresh prompts per point (median)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        raise SystemExit(why)
    # stopped (SIGTERM): the bed and the workers go as on any exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    hosts = ["redis", *WRITERS, *READERS]
    results = []
    with tempfile.TemporaryDirectory() as tmp, Bed(hosts) as bed:
        logs = Path(tmp)
        model = str(resolve(EMBEDDED))
        server = BedRedis(bed, logs / "redis").start()
        store = redis.Redis.from_url(server.url)
        args_of = {**WRITERS, **{h: [*a, *READER_ARGS] for h, a in READERS.items()}}
        workers = {h: BedWorker(bed, h, "decode", model, server.url, logs, "--num-blocks",
                                "1200", *a, dtype=DEFAULTS.model.dtype)
                   for h, a in args_of.items()}  # fmt: skip
        try:
            for w in workers.values():
                w.launch()
            for w in workers.values():
                w.wait_ready(300)
            print(
                f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                f"threads, netem: {bed.netem}",
                flush=True,
            )
            for rate in (float(r) for r in args.rates.split(",")):
                for delay in (float(d) for d in args.delays.split(",")):
                    for host in READERS:
                        bed.shape(host, Link(rate_bit=rate * 1e9, delay_ms=delay))
                    tag = f"r{rate}-d{delay}"
                    store.flushall()
                    warm(workers, store, tag)
                    rows = [
                        measure(workers, store, int(n), tag, args.repeats)
                        for n in args.lengths.split(",")
                    ]
                    link = f"{rate:g} Gbit/s" + (f", {delay:g} ms each way" if delay else "")
                    results.append({"link": link, "rows": rows})
                    print(table(rows, link) + "\n", flush=True)
        finally:
            for w in workers.values():
                w.stop(timeout=10)
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
