"""`pdserve bench`: load-test any OpenAI-compatible server; `pdserve bench compare A.json ...`.

    pdserve bench --base-url http://127.0.0.1:8000 --workload random --num-prompts 200 \\
        --request-rate 4 --input-len 256 --output-len 128 --result-file out/run.json --plot out/
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.load import report
from bench.load.client import Target
from bench.load.metrics import SLO, summarize
from bench.load.runner import LoadConfig, run
from bench.load.workloads import WORKLOADS, WorkloadConfig, build


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    server = p.add_argument_group("server")
    server.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)"
    )
    server.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    server.add_argument("--model", help="model id (default: the first of /v1/models)")
    server.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer key (default: $OPENAI_API_KEY)",
    )
    server.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="more request fields, e.g. '{\"temperature\": 0}'",
    )
    server.add_argument("--ignore-eos", action="store_true", help="generate output-len tokens")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    load = p.add_argument_group("load shape")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests (conversations) per second; inf: all at once",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 = Poisson, < 1 burstier",
    )
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    load.add_argument("--warmup", type=int, default=0, help="unmeasured requests first")
    load.add_argument("--duration", type=float, help="seconds to keep starting requests")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--sweep-rate", help="R1,R2,...: one run per rate, and a sweep plot")
    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument(
        "--tokenizer",
        default="embedded",
        help="builds prompts, counts tokens: embedded or a model dir",
    )
    work.add_argument("--input-len", type=int, default=256, help="tokens per prompt (per turn)")
    work.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    work.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r)..len*(1+r)"
    )
    work.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system tokens")
    work.add_argument("--groups", type=int, default=8, help="shared-prefix: prompt groups")
    work.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    work.add_argument("--dataset-path", type=Path, help="sharegpt JSON or trace JSONL")
    work.add_argument("--images-per-request", type=int, default=1, help="random-mm: images")
    work.add_argument("--image-sizes", default="224x224",
                      help="random-mm: WxH[,WxH...], one drawn per image")  # fmt: skip
    work.add_argument("--image-repeat", type=float, default=0.0,
                      help="random-mm: share of images repeated from earlier requests")  # fmt: skip
    work.add_argument("--documents", type=int, default=16, help="rag: documents in the pool")
    work.add_argument("--document-len", type=int, default=500, help="rag: tokens a document")
    work.add_argument("--documents-per-request", type=int, default=4,
                      help="rag: documents drawn per request, shuffled (with --extra-body "
                      "'{\"kv_reuse\": \"approximate\"}' reused where they "
                      "stand)")  # fmt: skip
    out = p.add_argument_group("results")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS",
    )
    out.add_argument("--result-file", type=Path, help="write the result JSON here")
    out.add_argument("--detailed", action="store_true", help="per-request records in the JSON")
    out.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots here")
    out.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:1] == ["compare"]:
        if len(argv) < 3:
            print("usage: pdserve bench compare A.json B.json [...]", file=sys.stderr)
            return 2
        print(report.compare([Path(a) for a in argv[1:]]))
        return 0
    args = parser().parse_args(argv)
    try:
        slo = SLO.parse(args.goodput)
    except ValueError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    if args.workload == "random-mm" and args.endpoint != "chat":
        print("pdserve bench: error: random-mm sends images: --endpoint chat", file=sys.stderr)
        return 2
    try:
        sizes = tuple(parse_size(s) for s in args.image_sizes.split(","))
    except ValueError as e:
        print(f"pdserve bench: error: --image-sizes: {e}", file=sys.stderr)
        return 2
    base = args.base_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    model = args.model or first_model(base, args.api_key)
    target = Target(base, args.endpoint, model, args.api_key, args.ignore_eos, args.extra_body)
    tokenizer = load_tokenizer(args.tokenizer)
    rates = (
        [float(r) for r in args.sweep_rate.split(",")] if args.sweep_rate else [args.request_rate]
    )
    results = []
    for rate in rates:
        workload = WorkloadConfig(
            args.workload, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
            args.prefix_len, args.groups, args.turns, args.dataset_path, seed=args.seed,
            images_per_request=args.images_per_request, image_sizes=sizes,
            image_repeat=args.image_repeat, documents=args.documents,
            document_len=args.document_len, documents_per_request=args.documents_per_request,
        )  # fmt: skip
        conversations = build(workload, tokenizer)
        load = LoadConfig(rate, args.burstiness, args.max_concurrency, args.warmup,
                          args.duration, args.seed, args.timeout, not args.no_progress)  # fmt: skip
        records, duration = asyncio.run(run(target, conversations, tokenizer, load))
        result = summarize(records, duration, slo) | {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "backend": "openai",
            "base_url": base,
            "endpoint": args.endpoint,
            "model": model,
            "workload": args.workload,
            "num_prompts": args.num_prompts,
            "request_rate": rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "usage_reported": all(r.usage_reported for r in records),
        }
        if args.detailed:
            result["requests"] = report.records_json(records)
        print(f"\n== {args.workload} workload, request rate {rate} ==")
        print(report.table(result))
        if args.plot:
            where = args.plot / f"rate-{rate:g}" if len(rates) > 1 else args.plot
            for path in report.plot_run(records, where, f"{args.workload} @ {rate:g} req/s"):
                print(f"wrote {path}")
        results.append(result)
    if args.plot and len(rates) > 1:
        print(f"wrote {report.plot_sweep(results, args.plot)}")
    if args.result_file:
        report.write_json(args.result_file, results[0] if len(results) == 1 else {"runs": results})
        print(f"wrote {args.result_file}")
    return 0


def parse_size(text: str) -> tuple[int, int]:
    width, _, height = text.strip().lower().partition("x")
    if not (width.isdigit() and height.isdigit()) or int(width) < 1 or int(height) < 1:
        raise ValueError(f"{text!r} is not WIDTHxHEIGHT")
    return int(width), int(height)


def first_model(base: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{base}/models", headers=headers, timeout=30)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(
            f"pdserve bench: error: cannot list {base}/models ({e}); give --model"
        ) from e


def load_tokenizer(name: str) -> Any:
    from services.model.loading import sources
    from services.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_dir(sources.resolve(name))
