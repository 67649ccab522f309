"""No import cycles among the modules of the three distributions (hp_cp_core, hp_cp_torch,
hp_cp_mindformers), read from the source files with ``ast`` (nothing is imported).

Every ``import`` / ``from ... import`` statement counts, those inside functions too (a lazy
import still ties the two modules together); ``from package import name`` is an edge to the
submodule ``package.name`` when there is one, else to ``package``. Imports under
``if TYPE_CHECKING:`` (annotations only) and imports by string (``importlib.import_module``,
the packages' lazy-name tables) are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = [REPO / d / "src" for d in ("hp_cp_core", "hp_cp_torch", "hp_cp_mindformers")]


def product_modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the three distributions."""
    modules = {}
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if _type_checking_only(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return nodes


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules that module ``name`` (file ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    known = product_modules()
    assert "hp_cp_torch.bench.suite" in known and "hp_cp_core.api" in known, sorted(known)
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    assert graph["hp_cp_torch.bench.suite"] >= {"hp_cp_torch.bench.scaling"}  # edges are seen
    assert import_cycles(graph) == []


def test_cycle_finder_sees_a_lazy_two_module_cycle() -> None:
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set()}
    assert import_cycles(graph) == [["a", "b"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
