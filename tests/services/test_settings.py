"""The one settings model: defaults < config file < PDSERVE_* environment < flags, with
sources reported, bad values refused naming where they came from."""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

import pytest

from services import settings
from services.launcher import PDSERVE


def parse(role: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, role)
    return parser.parse_args(argv)


def test_precedence_default_file_env_flag(tmp_path):
    config = tmp_path / "pdserve.toml"
    config.write_text(
        'policy = "least_load"\nmax_num_seqs = 16\nnum_blocks = 100\n'
        '[prefill]\nmax_num_seqs = 8\n[router]\napi_keys = ["a", "b"]\n'
    )
    env = {"PDSERVE_CONFIG": str(config), "PDSERVE_NUM_BLOCKS": "200"}
    loaded = settings.load("prefill", parse("prefill", "--num-blocks", "300"), env)
    s = loaded.settings
    e = s.engine
    assert (e.max_num_seqs, e.num_blocks, e.max_num_batched_tokens) == (8, 300, 512)
    assert loaded.sources["max_num_seqs"] == f"file {config}"
    assert loaded.sources["num_blocks"] == "flag --num-blocks"
    assert loaded.sources["max_num_batched_tokens"] == "default"
    router = settings.load("router", parse("router"), env).settings
    assert router.router.api_keys == ("a", "b") and router.router.policy == "least_load"
    assert router.engine.max_num_seqs == 16 and router.engine.num_blocks == 200  # env over file
    assert router.port == 8000 and s.port == 50051


def test_lists_booleans_and_optionals_from_every_source():
    env = {"PDSERVE_PREFILL": "a:1, b:2", "PDSERVE_WRITE_BACK": "off", "PDSERVE_PORT": "none"}
    s = settings.load("router", parse("router", "--decode", "c:3", "--decode", "d:4,e:5"), env)
    r = s.settings.router
    assert r.prefill == ("a:1", "b:2") and r.decode == ("c:3", "d:4", "e:5")
    assert s.settings.worker.write_back is False and s.settings.server.port is None
    decode = settings.load("decode", parse("decode", "--no-write-back"), {}).settings
    assert decode.worker.write_back is False


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PDSERVE_MAX_NUM_SEQS": "many"}, "PDSERVE_MAX_NUM_SEQS: invalid literal"),
        ({"PDSERVE_MAX_NUM_SEQS": "0"}, "PDSERVE_MAX_NUM_SEQS: must be at least 1"),
        ({"PDSERVE_POLICY": "random"}, "PDSERVE_POLICY: 'random' is not one of"),
        ({"PDSERVE_WRITE_BACK": "maybe"}, "PDSERVE_WRITE_BACK: not a boolean"),
    ],
)
def test_bad_values_name_their_source(env, message):
    with pytest.raises(settings.SettingsError, match=message):
        settings.load("decode", None, env)


def test_bad_files_are_refused(tmp_path):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("polcy = 'kv_aware'\n")
    with pytest.raises(settings.SettingsError, match="unknown settings: polcy"):
        settings.load("router", None, {"PDSERVE_CONFIG": str(unknown)})
    broken = tmp_path / "broken.toml"
    broken.write_text("policy = \n")
    with pytest.raises(settings.SettingsError, match=r"broken\.toml"):
        settings.load("router", None, {"PDSERVE_CONFIG": str(broken)})


def test_config_show_prints_values_and_sources(tmp_path):
    out = subprocess.run(
        [PDSERVE, "config", "show", "--role", "decode", "--max-num-seqs", "7"],
        env={"PDSERVE_KV_STORE": "redis://cache:6379/0", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert rows["max_num_seqs"][:3] == ["7", "flag", "--max-num-seqs"]
    assert rows["kv_store"][:3] == ["redis://cache:6379/0", "env", "PDSERVE_KV_STORE"]
    assert rows["port"][:2] == ["50052", "default"]
    assert "policy" not in rows  # a router setting
    bad = subprocess.run([PDSERVE, "config", "show"], env={"PDSERVE_DTYPE": "int3"},
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "pdserve: error: PDSERVE_DTYPE: 'int3' is not one of auto, float32, bfloat16, float16"
    )


def test_the_configuration_table_lists_every_setting():
    table = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for name in settings.names():
        row = f"| `{name}` | `{settings.flag_name(name)}` | `{settings.env_name(name)}` |"
        assert row in table, f"docs/configuration.md's table lacks {name}"


SOURCE_PACKAGES = ("services", "router", "prefill", "decode", "kvstore", "bench")


def restated_defaults(root: Path) -> list[str]:
    """Places outside services/settings/ that write a setting's default again, as the value
    of something named like the setting: a keyword argument, a parameter's default, a field
    or variable assigned (`max_num_seqs=64`, `def f(retry_wait: float = 30.0)`)."""
    defaults = {}
    for name, leaf in settings.leaves().items():
        default = leaf.field.default
        if default is not None and not isinstance(default, bool):
            defaults[name] = defaults[leaf.path[-1]] = default
    found = []
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "settings" in path.relative_to(root).parts[:2] or path.name.endswith("_pb2.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                for name, value in _named_values(node):
                    if (
                        name in defaults
                        and isinstance(value, ast.Constant)
                        and type(value.value) is type(defaults[name])
                        and value.value == defaults[name]
                    ):
                        found.append(f"{path.relative_to(root)}:{value.lineno} {name}")
    return sorted(found)


def _named_values(node: ast.AST) -> list[tuple[str, ast.AST]]:
    if isinstance(node, ast.keyword) and node.arg:
        return [(node.arg, node.value)]
    if isinstance(node, ast.arguments):
        positional = [*node.posonlyargs, *node.args]
        pairs = list(
            zip(positional[len(positional) - len(node.defaults) :], node.defaults, strict=True)
        )
        pairs += [
            (a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if d is not None
        ]
        return [(a.arg, d) for a, d in pairs]
    targets: list[ast.AST] = []
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    elif isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    names = [t.id if isinstance(t, ast.Name) else t.attr for t in targets
             if isinstance(t, ast.Name | ast.Attribute)]  # fmt: skip
    return [(n, value) for n in names]


def test_every_default_is_written_once():
    assert restated_defaults(Path(__file__).parents[2]) == []


def test_a_restated_default_is_found(tmp_path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "x.py").write_text(
        "def f(retry_wait: float = 30.0, imbalance=7):\n    g(max_num_seqs=64)\n"
        "class C:\n    max_n: int = 16\n"
    )
    assert restated_defaults(tmp_path) == [
        "router/x.py:1 retry_wait", "router/x.py:2 max_num_seqs", "router/x.py:4 max_n",
    ]  # fmt: skip
