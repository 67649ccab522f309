"""Drift check: every ``hp_cp_*`` hookspec documents each argument under ``Args:`` and has a
``test_hook_<name>`` somewhere under ``tests/`` (datasette's check)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from hp_cp_core import hookspecs

TESTS = Path(__file__).resolve().parent
SPECS = sorted(
    name
    for name, fn in vars(hookspecs).items()
    if name.startswith("hp_cp_") and inspect.isfunction(fn)
)


def test_the_contract_has_hooks() -> None:
    assert "hp_cp_backend" in SPECS and len(SPECS) >= 6


def documented_args(doc: str) -> set[str]:
    """Names listed in the docstring's ``Args:`` section (Google style)."""
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Args:") + 1
    names = set()
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next section (Returns:, prose, ...)
        m = re.match(r"^    (\w+)( \(.*\))?:", line)
        if m:
            names.add(m.group(1))
    return names


@pytest.mark.parametrize("name", SPECS)
def test_hookspec_documents_every_argument(name: str) -> None:
    fn = getattr(hookspecs, name)
    doc = fn.__doc__ or ""
    params = list(inspect.signature(fn).parameters)
    if params:  # a hook without arguments (hp_cp_backend_api) has no Args: section
        assert "Args:" in doc, f"{name} has no Args: section"
        assert documented_args(doc) == set(params), f"{name}: document exactly {params}"
    else:
        assert "Args:" not in doc, f"{name} takes no arguments: drop its Args: section"
    assert "Returns:" in doc and "versionadded" in doc


@pytest.mark.parametrize("name", SPECS)
def test_hookspec_has_a_test(name: str) -> None:
    pattern = re.compile(rf"^\s*def test_hook_{name}\(", re.MULTILINE)
    found = [p for p in TESTS.rglob("test_*.py") if pattern.search(p.read_text(encoding="utf-8"))]
    assert found, f"no test_hook_{name} under {TESTS}"
