"""The `pdserve` command: one entry point, a subcommand per role or tool."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from kvstore.block_hash import BLOCK_SIZE
from services import logs, settings
from services.engine.request import EngineRequest
from services.model.errors import ModelLoadError

# Roles register their entry points in pyproject.toml ([project.entry-points."pdserve.roles"]):
# the shared runtime runs them without importing the services built on it.
ROLE_GROUP = "pdserve.roles"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser (and `pdserve bench compare`)
        return int(role("bench")(argv[1:]))
    parser = _parser()
    args = parser.parse_args(argv)
    logs.configure()
    try:
        return int(args.run(args))
    except (ModelLoadError, settings.SettingsError) as e:
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
    conv.add_argument("--model", default="embedded", help=settings.MODEL_HELP)
    conv.set_defaults(run=_convert)

    for role, text in (
        ("prefill", "run a prefill worker (gRPC)"),
        ("decode", "run a decode worker (gRPC)"),
        ("router", "serve the OpenAI API in front of the workers"),
        ("up", "run router, prefill and decode workers and the KV store together"),
    ):
        command = sub.add_parser(role, help=text)
        settings.add_arguments(command, role)
        command.set_defaults(run=_serve, role=role)

    config = sub.add_parser("config", help="settings: `pdserve config show`")
    config_sub = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="print the settings in effect and their sources")
    show.add_argument("--role", choices=settings.ROLES, help="only the settings of this role")
    settings.add_arguments(show, None)
    show.set_defaults(run=_config_show)

    sub.add_parser("bench", help="load-test an OpenAI-compatible server (pdserve bench --help)")

    health = sub.add_parser("health", help="exit 0 if the service on --port is ready")
    health.add_argument("--port", type=int, help="default: PDSERVE_PORT, else 8000")
    health.add_argument("--live", action="store_true", help="answering at all is enough")
    health.set_defaults(run=_health)
    return parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help=settings.MODEL_HELP)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto = bfloat16 where the CPU has bf16 units, else float32",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8"],
        help="int8: the decoder layers' main products in int8 (services/model/quantize.py)",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "c", "torch", "triton"],
        help="attention and layer kernels: auto (Triton on CUDA, C on CPUs), c, torch, triton",
    )


def _serve(args: argparse.Namespace) -> int:
    loaded = settings.load(args.role, args)
    logs.configure(loaded.settings.log_level)
    s = loaded.settings
    if s.trace_file:  # refused now, not after the model has loaded
        try:
            with open(s.trace_file, "a"):
                pass
        except OSError as e:
            raise settings.SettingsError(f"trace_file: cannot append to {s.trace_file}: {e}") from e
    if args.role == "up":
        from services.up import up

        return up(s)
    return int(role(args.role)(s))


def role(name: str) -> Callable[..., Any]:
    """The entry point a role registered: router, prefill and decode take the Settings,
    bench its arguments; each returns an exit code."""
    for point in entry_points(group=ROLE_GROUP, name=name):
        loaded: Callable[..., Any] = point.load()
        return loaded
    raise settings.SettingsError(
        f"no `{name}` role installed (entry point group {ROLE_GROUP}): reinstall pdserve "
        "(make install)"
    )


def _config_show(args: argparse.Namespace) -> int:
    print(settings.show(settings.load(args.role or "up", args), args.role))
    return 0


def _health(args: argparse.Namespace) -> int:
    from services.health import probe

    port = args.port or int(os.environ.get("PDSERVE_PORT") or 8000)
    return 0 if probe(port, live=args.live) else 1


def _generate(args: argparse.Namespace) -> int:
    from services.engine.engine import Engine, EngineConfig
    from services.engine.params import SamplingParams, ValidationError
    from services.model.loader import load_model

    loaded = load_model(args.model, args.dtype, args.device, args.quantization, args.kernels)
    tok = loaded.tokenizer
    if args.chat:
        prompt = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = tok.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    blocks = -(-(len(prompt) + args.max_tokens) // BLOCK_SIZE)
    engine = Engine(loaded.model, tok, EngineConfig(num_blocks=max(blocks, 1)))
    try:
        engine.add_request(EngineRequest("cli", prompt, params))
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
