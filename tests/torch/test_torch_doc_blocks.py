"""The torch pages' code blocks, executed (``nox -s torch``): one job of 2 gloo ranks runs
every block of ``doc_block_cases`` with what its page says the reader has (a tiny model, the
CP process group, a batch) and checks it against the same model on one process; one test
per block reports its traceback. The command lines the pages show parse with the real
command-line parsers (``test_doc_commands.py``)."""

from __future__ import annotations

import socket

import pytest
from dist_utils import run_ranks
from doc_block_cases import CASES, doc_blocks_suite

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return run_ranks(2, doc_blocks_suite, _free_port(), timeout=600)


@pytest.mark.parametrize("blocks", list(CASES))
def test_the_doc_block_runs_under_cp(results, blocks: str) -> None:
    failed = {rank: r[blocks] for rank, r in enumerate(results) if r[blocks] is not None}
    assert not failed, "\n".join(f"rank {k}:\n{tb}" for k, tb in failed.items())


def test_every_block_name_is_asked_for() -> None:
    """The names the cases run (``docs.run("NAME", ...)`` / ``docs.block("NAME")``) are the
    names the registry lists."""
    import doc_block_cases

    names = {n for key in CASES for n in key.split(" + ")}
    assert names == {
        "readme-quickstart",
        "design-quickstart",
        "readme-hf-batch",
        "hf-training-step",
        "regather-stats",
        "train-fsdp-loop",
        "model-adapter-register",
        "model-example-run",
        "dsa-example-run",
        "glm5-sharing",
        "reliability-errors",
        "triton-kernel-config",
        "triton-plugin",
        "triton-plugin-host",
        "patch-function-forward",
    }
    assert all(doc_block_cases.docs.block(n) for n in names)


def test_the_guides_forward_state_fields_are_the_dataclasses() -> None:
    """docs/writing-a-model-adapter.md lists ``ForwardState``'s fields (one forward's values)
    in prose: the names it gives are the dataclass's fields, every one."""
    import dataclasses
    import re
    from pathlib import Path

    from hp_cp_torch.model.spec import ForwardState

    text = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-model-adapter.md").read_text(
        encoding="utf-8"
    )
    start = text.index("`ForwardState`\n(one forward's values:")
    listed = text[start : text.index("and the fields of your subclass", start)]
    listed = re.sub(r"\([^()]*\)", "", listed.split(":", 1)[1])  # drop the explanations
    names = set(re.findall(r"`(\w+)`", listed))
    assert names == {f.name for f in dataclasses.fields(ForwardState)}
