"""The one settings model: defaults < config file < PDSERVE_* environment < flags, with
sources reported, bad values refused naming where they came from."""

from __future__ import annotations

import argparse
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
    assert (s.max_num_seqs, s.num_blocks, s.max_num_batched_tokens) == (8, 300, 512)
    assert loaded.sources["max_num_seqs"] == f"file {config}"
    assert loaded.sources["num_blocks"] == "flag --num-blocks"
    assert loaded.sources["max_num_batched_tokens"] == "default"
    router = settings.load("router", parse("router"), env).settings
    assert router.api_keys == ("a", "b") and router.policy == "least_load"
    assert router.max_num_seqs == 16 and router.num_blocks == 200  # env over file
    assert router.port_for("router") == 8000 and s.port_for("prefill") == 50051


def test_lists_booleans_and_optionals_from_every_source():
    env = {"PDSERVE_PREFILL": "a:1, b:2", "PDSERVE_WRITE_BACK": "off", "PDSERVE_PORT": "none"}
    s = settings.load("router", parse("router", "--decode", "c:3", "--decode", "d:4,e:5"), env)
    assert s.settings.prefill == ("a:1", "b:2") and s.settings.decode == ("c:3", "d:4", "e:5")
    assert s.settings.write_back is False and s.settings.port is None
    assert (
        settings.load("decode", parse("decode", "--no-write-back"), {}).settings.write_back is False
    )


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


def test_readme_configuration_table_lists_every_setting():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for name in settings.Settings.names():
        row = f"| `{name}` | `{settings.flag_name(name)}` | `{settings.env_name(name)}` |"
        assert row in readme, f"README's configuration table lacks {name}"
