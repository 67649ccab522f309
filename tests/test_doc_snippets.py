"""Every ``<!-- snippet: PATH -->`` block in docs/*.md holds exactly the file PATH (which CI
runs), inside one fenced code block, closed by ``<!-- /snippet -->``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(
    r"<!-- snippet: (?P<path>\S+) -->\n```\w*\n(?P<body>.*?)```\n<!-- /snippet -->", re.S
)
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _blocks() -> list[tuple[str, str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        found = BLOCK.findall(text)
        assert len(found) == text.count("<!-- snippet:"), f"{doc.name}: a malformed snippet block"
        out += [(doc.name, path, body) for path, body in found]
    return out


def test_the_hf_distributed_config_snippet_is_embedded() -> None:
    paths = {path for _, path, _ in _blocks()}
    assert "examples/snippets/hf_distributed_config.py" in paths


@pytest.mark.parametrize(("doc", "path", "body"), _blocks(), ids=lambda v: str(v)[:40])
def test_snippet_equals_its_file(doc: str, path: str, body: str) -> None:
    assert body == (ROOT / path).read_text(), f"{doc}: the block of {path} differs from the file"
