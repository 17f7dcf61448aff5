"""How the packages may depend on each other, read from the source (ast): no import cycles
between modules; kvstore at the bottom, importing none of the services built on it; services
(the shared runtime) importing none of the roles or the benchmarks; the router importing
neither worker role, and prefill and decode importing neither each other. Every import counts:
those inside functions, and those under `if TYPE_CHECKING:` (a cycle through annotations still
ties the modules together, and is one moved import away from failing at run time)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "router", "prefill", "decode", "kvstore", "bench")
FORBIDDEN = {  # package -> the packages it must not import; bench may import all the others
    "kvstore": {"services", "router", "prefill", "decode", "bench"},
    "services": {"router", "prefill", "decode", "bench"},
    "router": {"prefill", "decode"},
    "prefill": {"decode"},
    "decode": {"prefill"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue  # generated stubs
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """Every name `tree` imports, wherever the import stands (in functions, under
    TYPE_CHECKING), relative imports made absolute from `name`."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    graph = {}
    for name, path in found.items():
        imported = _imported(ast.parse(path.read_text()), name, path.name == "__init__.py")
        graph[name] = _modules_of(imported, set(found)) - {name}
    return graph


def _modules_of(imported: set[str], known: set[str]) -> set[str]:
    """The known modules that imported names belong to (a name inside a module: the module)."""
    out = set()
    for target in imported:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target:
            out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def forbidden_imports(graph: dict[str, set[str]], forbidden: dict[str, set[str]]) -> list[str]:
    """'module imports dep' for each edge from a package to one it must not import."""
    return [
        f"{module} imports {dep}"
        for module, deps in sorted(graph.items())
        for dep in sorted(deps)
        if dep.split(".")[0] in forbidden.get(module.split(".")[0], set())
    ]


def test_the_reader_sees_imports_of_every_kind():
    source = """
import a.b
from a.c import d
from . import e
from .f import g
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from h import i
else:
    import j
def k():
    import l
"""
    seen = _imported(ast.parse(source), "p.q", is_package=False)
    assert {"a.b", "a.c.d", "p.e", "p.f.g", "h.i", "j", "l"} <= seen
    assert _imported(ast.parse("from .. import r"), "p.q.s", is_package=True) == {"p.q", "p.q.r"}
    known = {"a.b", "a.c", "p", "p.f", "h", "l"}
    assert _modules_of(seen, known) == {"a.b", "a.c", "p", "p.f", "h", "l"}

    graph = import_graph()
    assert "kvstore.codec" in graph["kvstore.blocks"]  # from kvstore.codec import ...
    assert "kvstore.memory" in graph["kvstore"]  # inside a function
    assert "services.engine.driver" in graph["services.worker.http"]  # under TYPE_CHECKING


def test_the_rules_catch_a_cycle_and_a_forbidden_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph = {
        "router.main": {"router.jobs", "services.settings"},
        "router.jobs": {"decode.worker"},
        "prefill.worker": {"services.worker.server", "decode.connector"},
        "decode.worker": {"services.worker.server"},
        "bench.run": {"router.main", "prefill.worker", "decode.worker"},
    }
    assert forbidden_imports(graph, FORBIDDEN) == [
        "prefill.worker imports decode.connector",
        "router.jobs imports decode.worker",
    ]


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_lower_layers_import_nothing_above_them():
    assert forbidden_imports(import_graph(), FORBIDDEN) == []


def test_the_router_process_does_not_import_torch():
    code = "import router.main, sys; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
