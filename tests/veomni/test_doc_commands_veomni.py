"""docs/veomni.md's benchmark commands (``nox -s veomni``): ``nox -s bench_peers_veomni``
runs ``bench/peers_veomni.py`` with the posargs the page passes, which its parser takes."""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


docs = SimpleNamespace(**runpy.run_path(str(ROOT / "tests" / "doc_blocks.py")))


Parsed = docs.Parsed


def _session_runs(session: str) -> str:
    """The script the noxfile's ``session`` passes its posargs to."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    (func,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == session]
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "run":
            args = [ast.unparse(a) for a in node.args]
            if "*session.posargs" in args:
                return ast.literal_eval(args[args.index("*session.posargs") - 1])
    raise AssertionError(f"{session} passes no posargs")


@pytest.mark.parametrize("name", ["veomni-bench-compare", "veomni-bench-memory"])
def test_the_bench_commands_parse(monkeypatch, name: str) -> None:
    docs.parse_only(monkeypatch)
    argvs = docs.commands(docs.block(name))
    assert argvs
    for argv in argvs:
        assert argv[:3] == ["nox", "-s", "bench_peers_veomni"] and argv[3] == "--", argv
        script = _session_runs("bench_peers_veomni")
        monkeypatch.setattr(sys, "argv", [script, *argv[4:]])
        with pytest.raises(Parsed):
            runpy.run_path(str(ROOT / script), run_name="__main__")
