"""Every fenced code block of README.md and docs/*.md is either a snippet of a file the tests
run or marked as not run, so a documented example cannot silently go stale:

* between ``<!-- snippet: PATH -->`` and ``<!-- /snippet -->``: the block's contents equal
  the file PATH (relative to the repository root);
* on the line right after ``<!-- tested: NAME -->``: a test under ``tests/`` asks for the
  block by NAME (``tests/doc_blocks.py``) and runs it with what the page says the reader has,
  or checks it against the code (a diagram's names, a listing's files, printed output, an
  excerpt's lines, a command line's flags);
* or on the line right after ``<!-- not run: REASON -->``, the reason saying why it cannot
  run here (it installs packages from the network or needs a GPU).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import runpy
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


docs = SimpleNamespace(**runpy.run_path(str(ROOT / "tests" / "doc_blocks.py")))
DOCS, TESTED, code_blocks = docs.DOCS, docs.TESTED, docs.code_blocks
SNIPPET = re.compile(r"^\s*<!-- snippet: (\S+) -->\s*$")
NOT_RUN = "<!-- not run: REASON -->"
NOT_RUN_MARK = re.compile(r"^\s*<!-- not run(?::\s*(?P<reason>\S.*?))?\s*-->\s*$")
BARE_NOT_RUN_PENDING: set[str] = set()
"""Pages whose bare ``<!-- not run -->`` markers still wait for a reason (their owners are
rewriting them, issue 57); every other page gives one."""


def problems(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for start, before, body in code_blocks(text):
        where = f"{path.relative_to(root)}:{start + 1}"
        mark = NOT_RUN_MARK.match(before)
        if mark is not None:
            pending = path.relative_to(root).as_posix() in BARE_NOT_RUN_PENDING
            if mark.group("reason") is None and not pending:
                found.append(f"{where}: `<!-- not run -->` without a reason; write {NOT_RUN}")
            continue
        if TESTED.match(before) is not None:
            continue  # test_every_tested_block_is_asked_for_by_a_test
        m = SNIPPET.match(before)
        if m is None:
            found.append(
                f"{where}: a code block neither marked `{NOT_RUN}`, `<!-- tested: NAME -->` "
                "nor a `<!-- snippet: PATH -->` of a tested file"
            )
            continue
        end = start + len(body) + 2
        if end >= len(lines) or lines[end].strip() != "<!-- /snippet -->":
            found.append(f"{where}: snippet of {m.group(1)} not closed by <!-- /snippet -->")
        source = root / m.group(1)
        if not source.is_file():
            found.append(f"{where}: snippet file {m.group(1)} does not exist")
        elif source.read_text(encoding="utf-8").rstrip("\n").splitlines() != body:
            found.append(f"{where}: differs from {m.group(1)}; copy the file into the block")
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_code_block_is_a_snippet_or_marked_not_run(path: Path) -> None:
    assert problems(path) == []


def test_the_check_catches_unmarked_blocks_and_stale_snippets(tmp_path: Path) -> None:
    (tmp_path / "ex.py").write_text("print('hi')\nx = 1\n", encoding="utf-8")
    good = "print('hi')\nx = 1"
    cases = {
        "```python\nx = 1\n```\n": "neither marked",
        f"<!-- snippet: ex.py -->\n```python\n{good}\nextra\n```\n<!-- /snippet -->\n": "differs",
        f"<!-- snippet: ex.py -->\n```python\n{good}\n```\n": "not closed",
        "<!-- snippet: nope.py -->\n```\n```\n<!-- /snippet -->\n": "does not exist",
        "<!-- not run -->\n```\nanything\n```\n": "without a reason",
    }
    doc = tmp_path / "doc.md"
    for text, expected in cases.items():
        doc.write_text(text, encoding="utf-8")
        got = problems(doc, tmp_path)
        assert len(got) == 1 and expected in got[0], (text, got)
    doc.write_text(
        "<!-- not run: needs a GPU -->\n```\nanything\n```\n"
        f"<!-- snippet: ex.py -->\n```python\n{good}\n```\n<!-- /snippet -->\n",
        encoding="utf-8",
    )
    assert problems(doc, tmp_path) == []


def test_every_tested_block_is_asked_for_by_a_test() -> None:
    """Each ``<!-- tested: NAME -->`` names one block, and a test module (not this one) asks
    for it by that name (``block("NAME")`` / ``run("NAME", ...)``)."""
    named = [name for name, *_ in docs.tested_blocks(DOCS)]
    assert len(named) == len(set(named)), sorted(n for n in named if named.count(n) > 1)
    sources = "".join(
        p.read_text(encoding="utf-8")
        for p in (ROOT / "tests").rglob("test_*.py")
        if p.resolve() != Path(__file__).resolve()
    )
    unasked = [n for n in named if f'"{n}"' not in sources]
    assert unasked == [], f"no test asks for these doc blocks: {unasked}"


NOT_RUN_LEFT = 12
"""Blocks still marked not run (they install packages from the network or need a GPU): the
count may only fall."""


def test_not_run_blocks_only_fall() -> None:
    marked = [
        f"{path.name}:{start + 1}"
        for path in DOCS
        for start, before, _ in code_blocks(path.read_text(encoding="utf-8"))
        if NOT_RUN_MARK.match(before)
    ]
    assert len(marked) <= NOT_RUN_LEFT, marked


NOT_RUN_REASONS = re.compile(r"^(installs packages|needs a GPU)\b")
"""What keeps a block from running here: it installs packages from the network or needs a
GPU. A fragment, a diagram, a listing, printed output, a command of many minutes are run or
checked instead (``<!-- tested: NAME -->``)."""


def test_not_run_only_where_it_cannot_run_here() -> None:
    reasons = [
        (f"{path.name}:{start + 1}", mark.group("reason"))
        for path in DOCS
        for start, before, _ in code_blocks(path.read_text(encoding="utf-8"))
        if (mark := NOT_RUN_MARK.match(before)) is not None
    ]
    assert [(w, r) for w, r in reasons if not NOT_RUN_REASONS.match(r or "")] == []


def test_readme_stays_short() -> None:
    """The README is the front page (what it is, install, the two commands, a short example,
    the matrix, links); everything longer belongs in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"


# ------------------------------------------------- the backend guide's wiring, executed

BACKEND_GUIDE = ROOT / "docs" / "writing-a-backend.md"
TORCH_PLUGIN = "hp_cp_torch/src/hp_cp_torch/_plugin.py"


def snippet_block(doc: Path, source: str) -> str:
    """The contents of ``doc``'s code block marked ``<!-- snippet: source -->``."""
    text = doc.read_text(encoding="utf-8")
    for start, before, body in code_blocks(text):
        m = SNIPPET.match(before)
        if m is not None and m.group(1) == source:
            return "\n".join(body) + "\n"
    raise AssertionError(f"{doc.name} has no snippet of {source}")


def test_the_backend_guides_entry_points_load_through_discovery() -> None:
    """The guide's ``pyproject.toml`` block: its ``hp_cp`` entry points, loaded by the core's
    own discovery (``PluginHost.discover``), register working backends."""
    tomllib = pytest.importorskip("tomllib")
    from hp_cp_core.plugins import ENTRY_POINT_GROUP, PluginHost

    project = tomllib.loads(snippet_block(BACKEND_GUIDE, "tests/fakes/pyproject.toml"))
    group = project["project"]["entry-points"][ENTRY_POINT_GROUP]
    host = PluginHost(autoload=False)
    host.discover([md.EntryPoint(n, v, ENTRY_POINT_GROUP) for n, v in group.items()])
    assert {n: (s.ok, s.error) for n, s in host.statuses.items()} == {
        "fake": (True, None),
        "legacy": (True, None),
    }


def test_the_backend_guides_runner_wiring_registers_with_the_core() -> None:
    """The guide's ``RunnerHooks`` block (the torch plugin, whole) runs without torch and
    registers with the core as a backend of the current API, every hook known."""
    from hp_cp_core import hookspecs
    from hp_cp_core.plugins import PluginHost
    from hp_cp_core.versions import BACKEND_API

    plugin = types.ModuleType("guide_plugin")
    exec(compile(snippet_block(BACKEND_GUIDE, TORCH_PLUGIN), "guide", "exec"), vars(plugin))
    host = PluginHost(autoload=False)
    host.add(plugin, "guide")
    status = host.statuses["guide"]
    assert (status.ok, status.error, status.backend_api) == (True, None, BACKEND_API)
    assert {n for n in vars(plugin) if n.startswith("hp_cp_")} == {
        n for n in dir(hookspecs) if n.startswith("hp_cp_")
    }


def _runner_hooks_call(source: str) -> dict[str, str]:
    """The keyword arguments of the ``RunnerHooks(...)`` call in ``source``, as source text."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RunnerHooks":
            return {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
    raise AssertionError("no RunnerHooks(...) call")


def test_the_runner_hooks_docstring_shows_the_real_wiring() -> None:
    """``hp_cp_core.runners``' example is the torch plugin's call, argument for argument."""
    import hp_cp_core.runners

    doc = hp_cp_core.runners.__doc__ or ""
    example = doc.split("::\n", 1)[1].split("\n\n", 1)[0]
    shown = _runner_hooks_call(re.sub(r"^    ", "", example, flags=re.M).replace("...", ""))
    real = _runner_hooks_call((ROOT / TORCH_PLUGIN).read_text(encoding="utf-8"))
    assert shown == real
