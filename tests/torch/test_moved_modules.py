"""The 0.1 flat module paths of hp_cp_torch (moved into kernels/, bench/, cli/ in 0.2): each
still imports, warns with the new path and gives the new module's objects; nothing in this
repository uses an old path."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hp_cp_torch._moved import MOVED_MODULES
from hp_cp_torch.bench import scaling, suite
from hp_cp_torch.cli import commands

REPO = Path(__file__).resolve().parents[2]
OLD_BENCH_NAMES = [*suite.__all__, "run", "step_config", "_predicted_recv", "STEP_VARIANTS"]
OLD_CLI_NAMES = ["main", "demo_refusal", "RANKS_PER_CORE", "RANK_MEMORY_BYTES", "TORCHRUN_ENV"]


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_old_module_path_warns_and_is_the_new_module(old: str) -> None:
    new = MOVED_MODULES[old]
    if "triton" in new and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    sys.modules.pop(old, None)  # a test before may have imported it (it warns only once)
    with pytest.warns(DeprecationWarning, match=re.escape(f"`{new}`")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is module


def test_old_bench_and_cli_names_warn_and_are_the_same_objects() -> None:
    import hp_cp_torch.bench
    import hp_cp_torch.cli

    for package, names, homes in [
        (hp_cp_torch.bench, OLD_BENCH_NAMES, (suite, scaling)),
        (hp_cp_torch.cli, OLD_CLI_NAMES, (commands,)),
    ]:
        for name in names:
            home = next(m for m in homes if name in vars(m))
            with pytest.warns(DeprecationWarning, match=re.escape(f"{home.__name__}.{name}`")):
                assert getattr(package, name) is getattr(home, name)


def test_the_packages_refuse_other_names_without_a_warning() -> None:
    import hp_cp_torch.bench

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
            hp_cp_torch.bench.no_such_name  # noqa: B018
        with pytest.raises(AttributeError):
            hp_cp_torch.bench.__wrapped__  # noqa: B018
        from hp_cp_torch.bench import kernel  # a submodule stays the submodule
    assert kernel.__name__ == "hp_cp_torch.bench.kernel"


def test_python_m_old_path_runs_the_new_module_and_warns() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-m", "hp_cp_torch.demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "`hp_cp_torch.demo` moved to `hp_cp_torch.cli.demo`" in done.stderr


def test_python_m_bench_runs_the_bench_command() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-m", "hp_cp_torch.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout


# ----------------------------------------------------------------- nothing here uses them

OLD_LEAVES = {old.rpartition(".")[2] for old in MOVED_MODULES}
OLD_PACKAGE_MODULES = {"hp_cp_torch.bench", "hp_cp_torch.cli"}  # 0.1 modules, packages now
SHIMS = {REPO / "hp_cp_torch/src/hp_cp_torch" / f"{leaf}.py" for leaf in OLD_LEAVES}
SKIP_DIRS = {".git", ".nox", "site", "build", "dist", "node_modules"}
OLD_TEXT = re.compile(
    rf"hp_cp_torch[./](?:{'|'.join(sorted(OLD_LEAVES))})\b(?!/)"
    r"|hp_cp_torch/(?:bench|cli)\.py|hp_cp_torch\.cli:main"
)


def _repo_files(suffixes: tuple[str, ...]) -> list[Path]:
    return [
        p
        for p in REPO.rglob("*")
        if p.suffix in suffixes
        and p.is_file()
        and not SKIP_DIRS & set(p.relative_to(REPO).parts)
        and not any(part.startswith(".venv") for part in p.relative_to(REPO).parts)
    ]


def old_path_imports(tree: ast.AST) -> list[str]:
    """The imports in ``tree`` that name a 0.1 module path."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in MOVED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in MOVED_MODULES:
                found.append(node.module)
            elif node.module == "hp_cp_torch":
                found += [f"hp_cp_torch.{a.name}" for a in node.names if a.name in OLD_LEAVES]
            elif node.module in OLD_PACKAGE_MODULES:
                found += [
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if importlib.util.find_spec(f"{node.module}.{a.name}") is None
                ]
    return found


def test_the_repository_imports_no_old_path() -> None:
    here = Path(__file__).resolve()
    sources = [p for p in _repo_files((".py",)) if p not in SHIMS and p != here]
    assert any(p.name == "test_bench.py" for p in sources)
    uses = {
        str(p.relative_to(REPO)): bad
        for p in sources
        if (bad := old_path_imports(ast.parse(p.read_text(), str(p))))
    }
    assert uses == {}


def test_the_docs_and_configs_name_no_old_path() -> None:
    here = Path(__file__).resolve()
    texts = [p for p in _repo_files((".md", ".toml", ".yml", ".sh", ".py", ".cfg", ".ini"))]
    skip = {REPO / "CHANGELOG.md", here, *SHIMS, REPO / "hp_cp_torch/src/hp_cp_torch/_moved.py"}
    uses = {
        str(p.relative_to(REPO)): OLD_TEXT.findall(p.read_text())
        for p in texts
        if p not in skip and OLD_TEXT.search(p.read_text())
    }
    assert uses == {}


def test_the_old_path_finders_see_old_paths() -> None:
    tree = ast.parse(
        "from hp_cp_torch import banded\nimport hp_cp_torch.launch\n"
        "from hp_cp_torch.bench import main, kernel\nfrom hp_cp_torch.cli import commands\n"
    )
    assert old_path_imports(tree) == [
        "hp_cp_torch.banded",
        "hp_cp_torch.launch",
        "hp_cp_torch.bench.main",
    ]
    assert OLD_TEXT.findall("`hp_cp_torch/bench_traffic.py`, python -m hp_cp_torch.demo") == [
        "hp_cp_torch/bench_traffic",
        "hp_cp_torch.demo",
    ]
    assert not OLD_TEXT.search("hp_cp_torch.cli.demo hp_cp_torch/kernels/banded.py")
