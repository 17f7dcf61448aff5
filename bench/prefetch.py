"""A long prompt's KV moving from prefill to decode, with and without the prefetch, on the
multi-host bed (tests/support/netbed.py; needs root and iproute2).

    python -m bench.prefetch [--rates 1,0.1] [--lengths 4096,8000] [--json F] [--plot F]

Hosts: a router (two, on one host: `--prefetch-tokens 0` and the default), Redis, a prefill
worker and a decode worker (the default dtype), the two workers' links shaped to the rate
(Redis's is not: a store on a fat link). Per rate and length, a fresh random prompt through
each router, streamed, greedy, 4 tokens: the first token comes from the prefill's reply, so
the transfer shows as the gap to the second (the decode worker has the prompt's KV then).
Meanwhile every 50 ms: the blocks in Redis (written by the prefill) and the decode worker's
store hits (read). Reported: TTFT, the gap to the second token, the read's bytes/s against
the link's rate (blocks x block bytes over the read's time from the worker's "fetched" log
line, without the prefetch), and a timeline plot of blocks written and read.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import grpc
import httpx
import redis
import torch

from services.model.loading.sources import EMBEDDED, resolve
from services.rpc import worker_pb2 as pb
from services.rpc import worker_pb2_grpc as pbg
from services.settings import DEFAULTS
from tests.support.bed_stack import BedRedis, BedRouter, BedWorker
from tests.support.cluster import MODEL, log_events, log_size
from tests.support.netbed import Bed, Link, unavailable

HOSTS = ["router", "redis", "p0", "d0"]
SAMPLE_S = 0.05


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Hits:
    """The decode worker's store hits, asked on one channel."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pbg.DecodeWorkerStub(self.channel)

    def __call__(self) -> int:
        return int(self.stub.Load(pb.LoadRequest(), timeout=2).store_hits)


def request(url: str, ids: list[int]) -> tuple[float, float]:
    """Seconds to the first and to the second streamed token."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    start, times = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter() - start)
    return times[0], times[1]


def run_one(url: str, store: redis.Redis, decode: BedWorker, ids: list[int]) -> dict[str, Any]:
    """One request with the timeline sampled around it."""
    timeline: list[tuple[float, int, int]] = []
    done = threading.Event()
    store_hits = Hits(decode.address)
    written0, read0 = store.dbsize(), store_hits()
    start = time.perf_counter()

    def sample() -> None:
        while not done.is_set():
            at = time.perf_counter() - start
            timeline.append((at, store.dbsize() - written0, store_hits() - read0))
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        first, second = request(url, ids)
    finally:
        done.set()
        sampler.join()
        store_hits.channel.close()
    return {"ttft": first, "second": second, "timeline": timeline}


def fetched_line(decode: BedWorker, since: int) -> dict[str, str]:
    return [e for e in log_events(decode, since) if e.get("msg") == "fetched"][-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="1,0.1", help="Gbit/s")
    ap.add_argument("--lengths", default="4096,8000")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        raise SystemExit(why)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    results = []
    with tempfile.TemporaryDirectory() as tmp, Bed(HOSTS) as bed:
        logs = Path(tmp)
        model = str(resolve(EMBEDDED))
        server = BedRedis(bed, logs / "redis").start()
        store = redis.Redis.from_url(server.url)
        dtype = DEFAULTS.model.dtype
        prefill = BedWorker(bed, "p0", "prefill", model, server.url, logs, dtype=dtype)
        decode = BedWorker(
            bed, "d0", "decode", model, server.url, logs, "--no-write-back", dtype=dtype
        )
        routers: dict[str, BedRouter] = {}
        try:
            for w in (prefill, decode):
                w.launch()
            for w in (prefill, decode):
                w.wait_ready(300)
            for name, extra in (("after", ["--prefetch-tokens", "0"]), ("prefetch", [])):
                routers[name] = BedRouter(bed, logs, [prefill.address], [decode.address], *extra)
                routers[name].start()
            print(f"{platform.processor() or platform.machine()}, netem: {bed.netem}", flush=True)
            print(
                "| link | prompt tokens | prefetch | TTFT ms | 2nd token ms | gap ms "
                "| read MB/s (of the link's) |\n| --- | --- | --- | --- | --- | --- | --- |"
            )
            for rate in (float(r) for r in args.rates.split(",")):
                for host in ("p0", "d0"):
                    bed.shape(host, Link(rate_bit=rate * 1e9))
                for length in (int(n) for n in args.lengths.split(",")):
                    for name, router in routers.items():
                        ids = random_prompt(length, zlib.crc32(f"{rate}-{length}-{name}".encode()))
                        since = log_size(decode)
                        row = run_one(router.url, store, decode, ids)
                        line = fetched_line(decode, since)
                        block_bytes = max(store.strlen(store.randomkey() or b"") for _ in range(9))
                        blocks, ms = int(line["blocks"]), float(line["ms"])
                        mbps = blocks * block_bytes / ms / 1000
                        row.update(
                            link=f"{rate:g} Gbit/s",
                            tokens=length,
                            mode=name,
                            read_mb_s=mbps,
                            link_mb_s=rate * 125,
                        )
                        results.append(row)
                        share = (
                            f"{mbps:.0f} ({mbps / (rate * 125):.0%})" if name == "after" else "-"
                        )
                        print(
                            f"| {rate:g} Gbit/s | {length} | {name} | {1000 * row['ttft']:.0f} "
                            f"| {1000 * row['second']:.0f} | "
                            f"{1000 * (row['second'] - row['ttft']):.0f} | {share} |",
                            flush=True,
                        )
        finally:
            for child in (*routers.values(), prefill, decode):
                child.stop(timeout=10)
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Blocks written and read against time, per link and mode, for the longest prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max(r["tokens"] for r in results)
    rows = [r for r in results if r["tokens"] == longest]
    links = sorted({r["link"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        for r in (r for r in rows if r["link"] == link):
            t = [p[0] for p in r["timeline"]]
            style = "-" if r["mode"] == "prefetch" else "--"
            if r["mode"] == "prefetch":
                ax.plot(t, [p[1] for p in r["timeline"]], "k:", label="written (prefill)")
            ax.plot(t, [p[2] for p in r["timeline"]], style, label=f"read ({r['mode']})")
            ax.axvline(r["second"], color="C0" if r["mode"] == "after" else "C1", alpha=0.4)
        ax.set_title(f"{link}, {longest} tokens (lines: 2nd token)")
        ax.set_xlabel("seconds since the request")
        ax.set_ylabel("blocks")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
