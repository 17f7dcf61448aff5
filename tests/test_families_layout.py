"""A family is one place (services/model/families/): no line outside it asks which family a
config or a model is, and the parts that move KV (the block manager, the connectors, the codec
and the store) name no kind of cache group. Read from the source (ast), as test_layout.py."""

from __future__ import annotations

import ast
from pathlib import Path

from services.model import families

ROOT = Path(__file__).resolve().parents[1]
FAMILY_PLACE = ROOT / "services" / "model" / "families"
SHARED = ("services", "router", "prefill", "decode", "kvstore")
# the names a family answers to: its model_types and Hugging Face architectures
NAMES = {*families.MODEL_TYPES, *families.ARCHITECTURES}
# the model classes of the families (and the base they share)
MODEL_CLASSES = {f.model.rpartition(":")[2] for f in families.FAMILIES} | {"PagedModel"}
# the kinds of cache group, by the words their code used for them
GROUP_WORDS = ("window", "latent", "mla", "v4", "sliding", "indexer")
KV_MOVERS = (
    "services/engine/block_manager.py",
    "services/engine/kv_connector.py",
    "services/worker/kv_link.py",
    "prefill/connector.py",
    "decode/connector.py",
    "kvstore/codec.py",
    "kvstore/blocks.py",
    "kvstore/store.py",
)


def shared_files() -> list[Path]:
    out = []
    for package in SHARED:
        for path in (ROOT / package).rglob("*.py"):
            if FAMILY_PLACE in path.parents or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            out.append(path)
    return out


def branches_on_a_family(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each place that asks which family: a comparison with a config's
    architecture or with a family's name, an isinstance test against a family's model."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "architecture" for s in sides):
                found.append((node.lineno, "compares an architecture"))
            names = {
                n.value for s in sides for n in ast.walk(s) if isinstance(n, ast.Constant)
            } & NAMES
            if names:
                found.append((node.lineno, f"compares with the family {sorted(names)}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if named & MODEL_CLASSES:
                found.append((node.lineno, f"tests for {sorted(named & MODEL_CLASSES)}"))
    return found


def test_no_line_outside_the_families_branches_on_a_family():
    found = []
    for path in shared_files():
        for line, what in branches_on_a_family(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not found, "\n".join(found)


def test_the_check_finds_each_kind_of_branch():
    code = (
        "if config.architecture == 'x':\n    pass\n"
        "kind = 'deepseek_v3' if name in ('gemma3_text', 'llama') else 'qwen2'\n"
        "ok = isinstance(model, DecoderModel | GptOssModel)\n"
        "other = isinstance(model, dict)\n"
        "regex = {'qwen2': 1}\n"
    )
    assert sorted(line for line, _ in branches_on_a_family(ast.parse(code))) == [1, 3, 4]


def test_what_moves_kv_names_no_kind_of_cache_group():
    found = []
    for name in KV_MOVERS:
        for i, line in enumerate((ROOT / name).read_text().lower().splitlines(), 1):
            words = [w for w in GROUP_WORDS if w in line]
            if words:
                found.append(f"{name}:{i}: {words}")
    assert not found, "\n".join(found)


def test_every_family_is_found_by_its_architectures_and_model_types():
    for family in families.FAMILIES:
        for architecture, model_type in family.architectures.items():
            assert family.name and model_type in families.MODEL_TYPES
            assert architecture in families.ARCHITECTURES
        assert (
            FAMILY_PLACE / family.name in {*FAMILY_PLACE.iterdir()}
            or (FAMILY_PLACE / f"{family.name}.py").is_file()
        )
