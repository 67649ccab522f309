"""The fenced code blocks of README.md and docs/*.md that tests run or check, by name.

A block marked ``<!-- tested: NAME -->`` (on the line right before its fence) is executed or
checked by a test that asks for it by that name: ``block("NAME")`` answers its contents, so the
test runs what the page shows, never a copy. ``tests/core/test_doc_snippets.py`` checks that every
name is unique and that some test under ``tests/`` asks for it.

Test modules of every session load this file by path, since each suite puts only its own
folder on ``sys.path``::

    docs = SimpleNamespace(**runpy.run_path(str(ROOT / "tests" / "doc_blocks.py")))
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
TESTED = re.compile(r"^\s*<!-- tested: (?P<name>[\w.-]+) -->\s*$")


def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """``(opening line index, the line before it, contents)`` of every fenced block; an
    indented block (in a list) loses its indentation."""
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


def tested_blocks(docs: list[Path] | None = None) -> list[tuple[str, Path, int, str]]:
    """``(name, page, line number, contents)`` of every ``<!-- tested: NAME -->`` block."""
    found = []
    for path in DOCS if docs is None else docs:
        for start, before, body in code_blocks(path.read_text(encoding="utf-8")):
            m = TESTED.match(before)
            if m is not None:
                found.append((m.group("name"), path, start + 1, "\n".join(body) + "\n"))
    return found


def block(name: str) -> str:
    """The contents of the block marked ``<!-- tested: name -->`` (exactly one)."""
    hits = [text for n, _, _, text in tested_blocks() if n == name]
    if len(hits) != 1:
        raise AssertionError(f"{len(hits)} doc blocks are marked <!-- tested: {name} -->")
    return hits[0]


def run(name: str, namespace: dict | None = None) -> dict:
    """Execute the Python block ``name`` in ``namespace`` (what the page says the reader has)
    and answer the namespace after it."""
    namespace = {"__name__": f"doc_block_{name}"} | dict(namespace or {})
    exec(compile(block(name), f"<doc block {name}>", "exec"), namespace)
    return namespace


def excerpt_problems(text: str, source: Path) -> list[str]:
    """Where ``text`` is not an excerpt of ``source``: split at lines that are ``...``, each
    part must be consecutive lines of the file (compared without leading and trailing blanks,
    blank lines of the part skipped)."""
    have = [ln.strip() for ln in source.read_text(encoding="utf-8").splitlines()]
    problems, parts, part = [], [], []
    for ln in text.splitlines():
        if ln.strip() in ("...", "# ..."):
            parts.append(part)
            part = []
        elif ln.strip():
            part.append(ln.strip())
    parts.append(part)
    for part in filter(None, parts):
        n = len(part)
        nonblank = [(i, ln) for i, ln in enumerate(have) if ln]
        lines = [ln for _, ln in nonblank]
        if not any(lines[i : i + n] == part for i in range(len(lines) - n + 1)):
            problems.append(f"not in {source.relative_to(ROOT)}: {part[0]!r} ... ({n} lines)")
    return problems


def commands(text: str) -> list[list[str]]:
    """The command lines of a shell block, as argv lists: continuation lines joined, a
    console block's ``$`` prompts stripped (its other lines are output), ``&&`` chains split,
    comments and leading ``NAME=value`` assignments dropped."""
    lines = text.splitlines()
    if any(ln.startswith("$ ") for ln in lines):
        kept, follow = [], False
        for ln in lines:
            if ln.startswith("$ ") or follow:
                kept.append(ln[2:] if ln.startswith("$ ") else ln)
            follow = ln.rstrip().endswith("\\")
        lines = kept
    joined = "\n".join(lines).replace("\\\n", " ")
    argvs = []
    for line in joined.splitlines():
        for part in re.split(r"\s&&\s", line):
            argv = shlex.split(part, comments=True)
            while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                argv.pop(0)
            if argv:
                argvs.append(argv)
    return argvs


class Parsed(Exception):
    """Raised by ``parse_args`` in place of running the command: it parsed (its only
    argument is the namespace)."""


def parse_only(monkeypatch) -> None:
    """Make ``ArgumentParser.parse_args`` parse (exit 2 on a bad flag), then raise
    :class:`Parsed` with the namespace instead of returning it, so a documented command line
    is checked against the real parser without running the command."""
    original = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
