"""Every fenced code block of README.md and docs/*.md is either a snippet of a file the tests
run or marked as not run, so a documented example cannot silently go stale:

* between ``<!-- snippet: PATH -->`` and ``<!-- /snippet -->``: the block's contents equal
  the file PATH (relative to the repository root);
* or on the line right after ``<!-- not run -->``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
SNIPPET = re.compile(r"^\s*<!-- snippet: (\S+) -->\s*$")
NOT_RUN = "<!-- not run -->"


def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """``(opening line index, the line before it, contents)`` of every fenced block."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j]]
        blocks.append((i, lines[i - 1] if i else "", body))
        i = j + 1
    return blocks


def problems(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for start, before, body in code_blocks(text):
        where = f"{path.relative_to(root)}:{start + 1}"
        if before.strip() == NOT_RUN:
            continue
        m = SNIPPET.match(before)
        if m is None:
            found.append(
                f"{where}: a code block neither marked `{NOT_RUN}` nor a "
                "`<!-- snippet: PATH -->` of a tested file"
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
    }
    doc = tmp_path / "doc.md"
    for text, expected in cases.items():
        doc.write_text(text, encoding="utf-8")
        got = problems(doc, tmp_path)
        assert len(got) == 1 and expected in got[0], (text, got)
    doc.write_text(
        "<!-- not run -->\n```\nanything\n```\n"
        f"<!-- snippet: ex.py -->\n```python\n{good}\n```\n<!-- /snippet -->\n",
        encoding="utf-8",
    )
    assert problems(doc, tmp_path) == []


def test_readme_stays_short() -> None:
    """The README is the front page (what it is, install, the two commands, a short example,
    the matrix, links); everything longer belongs in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
