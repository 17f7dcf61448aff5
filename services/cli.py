"""The `pdserve` command: one entry point, a subcommand per role or tool."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from services import logs
from services.model.errors import ModelLoadError

MODEL_HELP = 'model: "embedded" (SmolLM2-135M-Instruct), a .gguf file or a Hugging Face directory'


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logs.configure()
    try:
        return int(args.run(args))
    except ModelLoadError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate", help="run the model offline on one prompt and print the answer"
    )
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=_positive_int, default=128, help="tokens to generate")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature)")
    _add_model_args(gen)
    gen.set_defaults(run=_generate)

    conv = sub.add_parser("convert", help="write the model as a Hugging Face directory")
    conv.add_argument("--out", type=Path, required=True, help="output directory (new or empty)")
    conv.add_argument("--model", default="embedded", help=MODEL_HELP)
    conv.set_defaults(run=_convert)

    for role, text in (
        ("prefill", "run a prefill worker (gRPC)"),
        ("decode", "run a decode worker (gRPC)"),
    ):
        worker = sub.add_parser(role, help=text)
        _add_worker_args(worker, role)
        worker.set_defaults(run=_worker, role=role)

    router = sub.add_parser("router", help="serve the OpenAI API in front of the workers")
    _add_router_args(router)
    router.set_defaults(run=_router)

    up = sub.add_parser("up", help="run router, prefill and decode workers and the KV store")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.set_defaults(run=_up)
    return parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help=MODEL_HELP)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto = bfloat16 where the CPU has bf16 units, else float32",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")


def _add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051 if role == "prefill" else 50052)
    _add_model_args(p)
    p.add_argument("--kv-store", default="local://", help="memory://, local://PATH, redis://...")
    dtypes = "auto (as computed), float32, float16, bfloat16, fp8"
    p.add_argument("--kv-store-dtype", default="auto", help=f"stored blocks' dtype: {dtypes}")
    p.add_argument("--store-timeout", type=float, default=1.0, help="seconds per store call")
    p.add_argument("--num-blocks", type=_positive_int, help="KV blocks in the pool")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size if no --num-blocks")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds in-flight requests get on SIGTERM")  # fmt: skip
    if role == "decode":
        p.add_argument("--no-write-back", action="store_true",
                       help="do not write finished generations' blocks to the store")  # fmt: skip


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="embedded", help="where the tokenizer and template come from")
    p.add_argument("--served-model-name", help="the model id clients use")
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill worker (repeat, or comma-separate)")  # fmt: skip
    p.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                   help="a decode worker (repeat, or comma-separate)")  # fmt: skip
    p.add_argument(
        "--policy", default="kv_aware", choices=["round_robin", "least_load", "kv_aware"]
    )
    p.add_argument("--disagg-threshold", type=int, default=0,
                   help="prompts with fewer uncached tokens skip prefill (0: off)")  # fmt: skip
    p.add_argument("--api-key", action="append", default=[], help="accepted API key (repeat)")
    p.add_argument("--admin-key", help="key for /admin/workers (off without one)")
    p.add_argument("--max-pending", type=_positive_int, default=256,
                   help="requests in flight before 429")  # fmt: skip
    p.add_argument("--health-interval", type=float, default=1.0)
    p.add_argument("--prefill-timeout", type=float, default=120.0,
                   help="seconds a Prefill may take before another worker is tried")  # fmt: skip


def _router(args: argparse.Namespace) -> int:
    from router.config import RouterConfig
    from router.main import serve

    def split(values: list[str]) -> tuple[str, ...]:
        return tuple(a for v in values for a in v.split(",") if a)

    serve(RouterConfig(
        host=args.host, port=args.port, model=args.model,
        served_model_name=args.served_model_name, prefill=split(args.prefill),
        decode=split(args.decode), policy=args.policy, disagg_threshold=args.disagg_threshold,
        api_keys=tuple(args.api_key), admin_key=args.admin_key, max_pending=args.max_pending,
        health_interval=args.health_interval, prefill_timeout=args.prefill_timeout,
    ))  # fmt: skip
    return 0


def _worker(args: argparse.Namespace) -> int:
    import asyncio

    from services.worker.server import WorkerConfig

    config = WorkerConfig(
        role=args.role,
        host=args.host,
        port=args.port,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_store=args.kv_store,
        kv_store_dtype=args.kv_store_dtype,
        store_timeout=args.store_timeout,
        num_blocks=args.num_blocks,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        grace_period=args.grace_period,
        write_back=not getattr(args, "no_write_back", False),
    )
    # The CLI is the one place that knows every role; the roles' code is imported here only.
    if args.role == "prefill":
        from prefill.worker import PrefillWorker

        asyncio.run(PrefillWorker(config).serve())
    else:
        from decode.worker import DecodeWorker

        asyncio.run(DecodeWorker(config).serve())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from services.engine.engine import Engine, EngineConfig
    from services.engine.params import SamplingParams, ValidationError
    from services.model.loader import load_model

    loaded = load_model(args.model, args.dtype, args.device)
    tok = loaded.tokenizer
    if args.chat:
        prompt = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = tok.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    blocks = -(-(len(prompt) + args.max_tokens) // 16)
    engine = Engine(loaded.model, tok, EngineConfig(num_blocks=max(blocks, 1)))
    try:
        engine.add_request("cli", prompt, params)
    except ValidationError as e:
        print(f"pdserve: error: {e.message}", file=sys.stderr)
        return 2
    while engine.has_unfinished:
        for delta in engine.step():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from services.model.sources import convert

    out = convert(args.model, args.out)
    print(f"wrote {out}")
    return 0


def _up(args: argparse.Namespace) -> int:
    print(
        "pdserve: error: `pdserve up` (router + workers) is not built yet; "
        "run `pdserve generate --chat --prompt ...` to use the model offline",
        file=sys.stderr,
    )
    return 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
