"""Where a role's settings come from, lowest first: their defaults (services/settings/
sections.py); a TOML config file (`--config` or `PDSERVE_CONFIG`; top-level keys for every
role, and tables `[router]`, `[prefill]`, `[decode]`, `[up]` for one); an environment
variable `PDSERVE_<NAME>`; a command-line flag `--<name>`. `pdserve config show` prints the
values in effect and where each came from.

Names are flat (a setting's name is unique across sections); lists (worker addresses, API
keys) are comma-separated in the environment, lists or strings in the file, and repeated or
comma-separated flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.settings.sections import ROLES, SECRETS, Settings, SettingsError


@dataclass(frozen=True)
class Leaf:
    """One setting: where it sits in `Settings` and how it reads."""

    name: str  # flat: file key, PDSERVE_<NAME>, --<name>
    path: tuple[str, ...]  # attributes from Settings down to the field
    field: dataclasses.Field[Any]
    kind: type  # str, int, float, bool or tuple (of str)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.field.metadata["roles"])

    @property
    def optional(self) -> bool:
        return self.field.default is None


@dataclass(frozen=True)
class Loaded:
    settings: Settings
    sources: dict[str, str]  # name -> "default", "file PATH", "env PDSERVE_X" or "flag --x"


@functools.cache
def leaves() -> dict[str, Leaf]:
    """Every setting by its flat name, in declaration order."""
    out: dict[str, Leaf] = {}

    def walk(cls: type, path: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(typing.cast(type, hint), (*path, f.name))
            elif "help" in f.metadata:
                name = f.metadata.get("name", f.name)
                assert name not in out, f"two settings named {name}"
                out[name] = Leaf(name, (*path, f.name), f, _kind(hint))

    walk(Settings, ())
    return out


def _kind(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = args[0]
    return tuple if typing.get_origin(hint) is tuple else typing.cast(type, hint)


def names(role: str | None = None) -> list[str]:
    """The settings `role` takes (every one with None)."""
    return [n for n, leaf in leaves().items() if role is None or role in leaf.roles]


def value(settings: Settings, name: str) -> Any:
    """A setting's value by its flat name."""
    node: Any = settings
    for attribute in leaves()[name].path:
        node = getattr(node, attribute)
    return node


def build(role: str = "up", **values: Any) -> Settings:
    """Settings for `role` from flat names (`build(num_blocks=8, policy="least_load")`), the
    others at their defaults."""
    unknown = set(values) - set(leaves())
    if unknown:
        raise SettingsError(f"unknown settings: {', '.join(sorted(unknown))}")
    tree: dict[str, Any] = {}
    for name, v in values.items():
        *parents, last = leaves()[name].path
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return _make(Settings, {"role": role, **tree})


def replace(settings: Settings, **values: Any) -> Settings:
    """`settings` with some values changed, by flat name."""
    current = {n: value(settings, n) for n in leaves()}
    return build(settings.role, **(current | values))


def _make(cls: type, tree: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {
        k: _make(typing.cast(type, hints[k]), v) if isinstance(v, dict) else v
        for k, v in tree.items()
    }
    return cls(**kwargs)


def env_name(name: str) -> str:
    return "PDSERVE_" + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(
    parser: argparse.ArgumentParser, role: str | None, only: Iterable[str] | None = None
) -> None:
    """A flag per setting of `role` (all settings with None; just `only` when given); unset
    flags leave no value."""
    parser.add_argument(
        "--config",
        type=Path,
        default=argparse.SUPPRESS,
        help="TOML settings file (also PDSERVE_CONFIG)",
    )
    chosen = set(only) if only is not None else None
    for name in names(role):
        if chosen is not None and name not in chosen:
            continue
        leaf = leaves()[name]
        text = leaf.field.metadata["help"].replace("%", "%%")  # argparse formats help with %
        common: dict[str, Any] = {
            "default": argparse.SUPPRESS, "help": f"{text} [{env_name(name)}]", "dest": name,
        }  # fmt: skip
        if leaf.kind is bool:
            parser.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, **common)
        elif leaf.kind is tuple:
            parser.add_argument(flag_name(name), action="append", metavar="VALUE", **common)
        else:
            choices = leaf.field.metadata.get("choices")
            parser.add_argument(
                flag_name(name),
                choices=choices,
                metavar=None if choices else name.upper(),
                **common,
            )


def load(
    role: str,
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
) -> Loaded:
    """The settings `role` runs with: defaults < file < environment < flags."""
    env = os.environ if env is None else env
    given = vars(args) if args is not None else {}
    values: dict[str, Any] = {}
    sources = dict.fromkeys(leaves(), "default")
    path = given.get("config") or env.get("PDSERVE_CONFIG")
    if path:
        for name, raw in _read_file(Path(path), role).items():
            values[name] = _convert(name, raw, f"{path}: {name}")
            sources[name] = f"file {path}"
    for name in leaves():
        if env_name(name) in env:
            where = env_name(name)
            values[name] = _convert(name, env[where], where)
            sources[name] = f"env {where}"
        if name in given:
            where = flag_name(name)
            raw = given[name]
            raw = ",".join(raw) if isinstance(raw, list) else raw
            values[name] = _convert(name, raw, where)
            sources[name] = f"flag {where}"
    return Loaded(build(role, **values), sources)


def _read_file(path: Path, role: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SettingsError(f"{path}: {e}") from e
    merged: dict[str, Any] = {}
    for key, raw in data.items():
        if key in ROLES and isinstance(raw, dict):
            continue
        merged[key.replace("-", "_")] = raw
    if isinstance(data.get(role), dict):
        merged.update({k.replace("-", "_"): v for k, v in data[role].items()})
    unknown = sorted(set(merged) - set(leaves()))
    if unknown:
        raise SettingsError(f"{path}: unknown settings: {', '.join(unknown)}")
    return merged


def _convert(name: str, raw: Any, where: str) -> Any:
    leaf = leaves()[name]
    kind = leaf.kind
    try:
        if leaf.optional and isinstance(raw, str) and raw.strip().lower() in ("", "none"):
            return None
        if kind is tuple:
            items = raw if isinstance(raw, list) else str(raw).split(",")
            return tuple(str(x).strip() for x in items if str(x).strip())
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"not a boolean: {raw!r}")
            return text in ("1", "true", "yes", "on")
        converted = kind(raw)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"{where}: {e}") from e
    choices = leaf.field.metadata.get("choices")
    if choices and converted not in choices:
        raise SettingsError(f"{where}: {converted!r} is not one of {', '.join(choices)}")
    minimum = leaf.field.metadata.get("minimum")
    if minimum is not None and converted < minimum:
        raise SettingsError(f"{where}: must be at least {minimum}, got {converted}")
    return converted


def read_secrets(path: str, where: str) -> tuple[str, ...]:
    """The non-empty lines of a secrets file (keys, one per line; `#` starts a comment)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SettingsError(f"{where}: {e}") from e
    found = tuple(x.strip() for x in lines if x.strip() and not x.strip().startswith("#"))
    if not found:
        raise SettingsError(f"{where}: {path} holds no key")
    return found


def child_env(settings: Settings, role: str) -> dict[str, str]:
    """PDSERVE_* variables that give a child process of `role` these settings."""
    out = {}
    for name in names(role):
        v = value(settings, name)
        if v is None:
            continue
        out[env_name(name)] = ",".join(v) if isinstance(v, tuple) else str(v)
    return out


def show(loaded: Loaded, role: str | None) -> str:
    """The settings in effect as a table: name, value, where it came from, its variable."""
    rows = [("setting", "value", "from", "environment")]
    for name in names(role):
        v = value(loaded.settings, name)
        if name == "port":
            v = loaded.settings.port
        if name == "kv_store":
            from kvstore.store import redact  # a password in the URL

            v = redact(v)
        if name in SECRETS and v:
            v = "<set>" if isinstance(v, str) else ",".join("<set>" for _ in v)
        elif isinstance(v, tuple):
            v = ",".join(v)
        rows.append((name, str(v), loaded.sources[name], env_name(name)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows
    )
