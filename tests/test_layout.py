"""How the packages may depend on each other, read from the source (ast): no import cycles
between modules; kvstore at the bottom, importing none of the services built on it; services
(the shared runtime) importing none of the roles or the benchmarks. Imports under
`if TYPE_CHECKING:` are annotations only and do not count; imports inside functions do."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "router", "prefill", "decode", "kvstore", "bench")
FORBIDDEN = {
    "kvstore": {"services", "router", "prefill", "decode", "bench"},
    "services": {"router", "prefill", "decode", "bench"},
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


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    out: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    graph = {}
    for name, path in found.items():
        deps = set()
        for target in _imported(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            while target and target not in found:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


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


def test_the_reader_sees_imports_of_every_kind():
    graph = import_graph()
    assert "kvstore.codec" in graph["kvstore.blocks"]  # from kvstore.codec import ...
    assert "kvstore.memory" in graph["kvstore"]  # inside a function
    assert "services.worker.server" not in graph["services.worker.http"]  # TYPE_CHECKING only
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_lower_layers_import_nothing_above_them():
    wrong = [
        f"{module} imports {dep}"
        for module, deps in import_graph().items()
        for dep in sorted(deps)
        if dep.split(".")[0] in FORBIDDEN.get(module.split(".")[0], set())
    ]
    assert wrong == []


def test_the_router_process_does_not_import_torch():
    code = "import router.main, sys; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
