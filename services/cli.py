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
    settings.add_arguments(gen, "generate")
    gen.set_defaults(run=_generate)

    conv = sub.add_parser("convert", help="write the model as a Hugging Face directory")
    conv.add_argument("--out", type=Path, required=True, help="output directory (new or empty)")
    settings.add_arguments(conv, "generate", only=["model"])
    conv.set_defaults(run=_convert)

    for role, text in (
        ("prefill", "run a prefill worker (gRPC)"),
        ("decode", "run a decode worker (gRPC)"),
        ("encode", "run an encode worker: a model's vision tower alone (gRPC)"),
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


def _serve(args: argparse.Namespace) -> int:
    loaded = settings.load(args.role, args)
    logs.configure(loaded.settings.server.log_level)
    if args.role == "up":  # checks every role's settings itself, then starts them
        from services.up import up

        return up(loaded.settings)
    s = settings.check(loaded.settings)  # refused now, not after the model has loaded
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
    from services.engine.engine import Engine
    from services.engine.params import SamplingParams, ValidationError
    from services.model.loader import load_model

    ms = settings.load("generate", args).settings.model
    loaded = load_model(
        ms.model, ms.dtype, ms.device, ms.quantization, ms.kernels, ms.deterministic
    )
    tok = loaded.tokenizer
    if args.chat:
        prompt = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = tok.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    blocks = -(-(len(prompt) + args.max_tokens) // BLOCK_SIZE)
    engine = Engine(loaded.model, tok, settings.EngineConfig(num_blocks=max(blocks, 1)))
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
    from services.model.loading.sources import convert

    out = convert(settings.load("generate", args).settings.model.model, args.out)
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
