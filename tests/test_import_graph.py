"""No import cycles among the modules of the three distributions (hp_cp_core, hp_cp_torch,
hp_cp_mindformers), read from the source files with ``ast`` (nothing is imported).

Every ``import`` / ``from ... import`` statement counts, those inside functions too (a lazy
import still ties the two modules together) and those under ``if TYPE_CHECKING:`` (an
annotation-only import is still a dependency: two modules that need each other's types belong
in one module, or their shared types in a third that imports neither); ``from package import
name`` is an edge to the submodule ``package.name`` when there is one, else to ``package``.
Imports by string (``importlib.import_module``, the packages' lazy-name tables) are not edges.
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


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules that module ``name`` (file ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def test_type_checking_imports_are_edges(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.a import A\n"
        "if typing.TYPE_CHECKING:\n"
        "    from . import c\n"
    )
    (tmp_path / "pkg" / "c.py").write_text("")
    known = {n: tmp_path / "pkg" / f"{n.split('.')[-1]}.py" for n in ("pkg.a", "pkg.b", "pkg.c")}
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a", "pkg.c"}, "pkg.c": set()}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_the_torch_collectives_do_not_import_the_model_dispatch() -> None:
    """``hp_cp_torch.backend`` (groups, collectives) reaches no model adapter: not the dispatch
    (``hp_cp_torch.adapter``), the registry of models or any integration, even indirectly."""
    known = product_modules()
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    reached, todo = set(), ["hp_cp_torch.backend"]
    while todo:
        for dep in graph[todo.pop()] - reached:
            reached.add(dep)
            todo.append(dep)
    assert "hp_cp_torch.adapter" in known and "hp_cp_torch.model.registry" in known
    models = {"hp_cp_torch.adapter", "hp_cp_torch.model.registry", "hp_cp_torch.model.spec"}
    assert not reached & models, sorted(reached & models)
    assert not {m for m in reached if m.startswith("hp_cp_torch.integrations")}


LAYERS = (
    ("hp_cp_torch.distributed", "hp_cp_torch._removed"),
    ("hp_cp_torch.kernels",),
    ("hp_cp_torch.attention", "hp_cp_torch.backend"),
    ("hp_cp_torch.model",),
    ("hp_cp_torch", "hp_cp_torch.adapter", "hp_cp_torch.reference", "hp_cp_torch._plugin"),
    ("hp_cp_torch.training",),
    ("hp_cp_torch.integrations",),
    ("hp_cp_torch.cli",),
    ("hp_cp_torch.bench",),
    ("hp_cp_torch._compat",),
)
"""hp_cp_torch's layers, lowest first, as its folders read (docs/index.md): around the
collectives (per-forward records, the desync report, exit) and the kernels, which import
nothing of hp_cp_torch above them; the kernel dispatch and the collectives; the model
contract and its runner; what installs it (the dispatch, the plugin, the reference layer);
the training helpers; the model files; the command line (which runs a model); the
benchmarks (which drive the command line's launcher); 0.4's import paths, which alias
modules of every layer. The core (and hp_cp_mindformers) is below them all."""


def layer_of(module: str) -> int:
    """0: the core (and hp_cp_mindformers); then :data:`LAYERS`, from 1. A module belongs to
    the longest prefix that names it (``hp_cp_torch.model.spec`` to ``hp_cp_torch.model``,
    ``hp_cp_torch`` itself to the package's layer)."""
    if not module.startswith("hp_cp_torch"):
        return 0
    best, layer = "", 0
    for number, prefixes in enumerate(LAYERS, start=1):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, layer = prefix, number
    assert layer, f"{module} is in no layer of LAYERS"
    return layer


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The imports from a lower layer into a higher one (``"a -> b"``)."""
    return [
        f"{m} -> {d}"
        for m, deps in sorted(graph.items())
        for d in sorted(deps)
        if layer_of(d) > layer_of(m)
    ]


def test_no_import_runs_back_up_a_layer() -> None:
    """The command line reaches the benchmarks only through their entry point (group
    ``hp_cp.commands``), and no model file reaches the command line (0.3's
    ``transformers_demo -> cli.parity`` and ``cli -> bench`` are gone)."""
    known = product_modules()
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    assert graph["hp_cp_torch.bench.suite"] & {"hp_cp_torch.cli.launch"}  # bench is above cli
    assert upward_imports(graph) == []
    assert upward_imports({"hp_cp_torch.cli.commands": {"hp_cp_torch.bench.suite"}}) == [
        "hp_cp_torch.cli.commands -> hp_cp_torch.bench.suite"
    ]


def named_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules that module ``name`` names in a string to import later: a lazy
    ``"package.module:attr"`` or a module's exact name (docstrings left out)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            module = node.value.partition(":")[0]
            if module in known and module != name:
                found.add(module)
    return found


def test_no_cycle_or_upward_arrow_hides_behind_a_string_import() -> None:
    """Imports by string (``importlib``, the plugin's and the packages' lazy tables) count as
    edges too: still no cycle, no arrow up a layer (0.3's ``deprecation.py`` loaded the
    integrations by name, and they imported it)."""
    known = product_modules()
    graph = {
        name: imported_modules(name, path, known) | named_modules(name, path, known)
        for name, path in known.items()
    }
    assert "hp_cp_torch.adapter" in graph["hp_cp_torch._plugin"]  # its lazy hooks are seen
    assert import_cycles(graph) == []
    assert upward_imports(graph) == []


def test_every_part_of_hp_cp_torch_has_its_layer_and_each_folder_says_what_it_may_import() -> None:
    """Each top-level module and folder of hp_cp_torch is named in :data:`LAYERS` (a new one
    is placed on purpose, not by default), a model-side import from a kernel would be an arrow
    up, and each folder's docstring says what it owns and what it may import."""
    package = REPO / "hp_cp_torch" / "src" / "hp_cp_torch"
    named = {prefix for prefixes in LAYERS for prefix in prefixes}
    parts = {
        f"hp_cp_torch.{p.stem}"
        for p in package.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()
    }
    assert parts - named == set(), sorted(parts - named)
    assert upward_imports({"hp_cp_torch.kernels.picked": {"hp_cp_torch.model.runner"}}) == [
        "hp_cp_torch.kernels.picked -> hp_cp_torch.model.runner"
    ]
    assert layer_of("hp_cp_torch.model.spec") == layer_of("hp_cp_torch.model")
    for init in sorted(package.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "may import" in doc.lower(), f"{init.relative_to(REPO)}: no 'May import' paragraph"
