"""The command lines the torch pages show (training runs under torchrun, benchmarks of many
minutes, the contract suite) parse with the real parsers: torchrun's own, the recipe's, ``hp-cp
bench``'s, the contract plugin's options; a Python call shown binds to the function's
signature. Running them is what the example_train suite and the bench sessions do."""

from __future__ import annotations

import argparse
import inspect
import re
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


docs = SimpleNamespace(**runpy.run_path(str(ROOT / "tests" / "doc_blocks.py")))


Parsed = docs.Parsed


@pytest.fixture
def parse_only(monkeypatch):
    """Command lines parse without running (:func:`doc_blocks.parse_only`)."""
    docs.parse_only(monkeypatch)
    return monkeypatch


def _script_parses(monkeypatch, script: str, args: list[str]) -> argparse.Namespace:
    path = ROOT / script
    assert path.is_file(), script
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(Parsed) as parsed:
        runpy.run_path(str(path), run_name="__main__")
    return parsed.value.args[0]


@pytest.mark.parametrize("name", ["torchrun-recipe", "torchrun-hf-parallel"])
def test_torchrun_commands_parse(parse_only, name: str) -> None:
    from torch.distributed.run import get_args_parser

    argvs = docs.commands(docs.block(name))
    assert argvs and all(argv[0] == "torchrun" for argv in argvs), argvs
    for argv in argvs:
        with pytest.raises(Parsed) as parsed:
            get_args_parser().parse_args(argv[1:])
        run = parsed.value.args[0]
        got = _script_parses(parse_only, run.training_script, run.training_script_args)
        assert got.steps > 0


@pytest.mark.parametrize("name", ["bench-long-runs", "bench-long-hf", "bench-megatron"])
def test_bench_commands_parse(parse_only, name: str) -> None:
    from hp_cp_torch.cli.commands import main

    argvs = docs.commands(docs.block(name))
    assert argvs and all(argv[:2] == ["hp-cp", "bench"] for argv in argvs), argvs
    for argv in argvs:
        with pytest.raises(Parsed):
            main(argv[1:])


def test_the_long_measure_call_binds(monkeypatch) -> None:
    """``python -c "...long_measures(...)"``: run with the function replaced by its
    signature's ``bind``."""
    import hp_cp_torch.bench.long as long

    (argv,) = docs.commands(docs.block("bench-long-1m"))
    assert argv[:2] == ["python", "-c"], argv
    bound = []
    signature = inspect.signature(long.long_measures)
    monkeypatch.setattr(
        long, "long_measures", lambda *a, **k: bound.append(signature.bind(*a, **k))
    )
    exec(argv[2], {})
    assert len(bound) == 1


def test_the_contract_suite_commands_use_its_options() -> None:
    """``pytest -p hp_cp_core.testing.contract`` and the options the page passes are the
    plugin's (its ``pytest_addoption``)."""
    import hp_cp_core.testing.contract as contract

    class Options:
        def __init__(self) -> None:
            self.names: set[str] = set()

        def getgroup(self, *args, **kwargs):
            return self

        def addoption(self, *names, **kwargs):
            self.names.update(names)

    options = Options()
    contract.pytest_addoption(options)
    for argv in docs.commands(docs.block("contract-suite-commands")):
        assert argv[:3] == ["pytest", "-p", "hp_cp_core.testing.contract"], argv
        flags = {a.split("=", 1)[0] for a in argv[3:] if a.startswith("--")}
        assert flags <= options.names, flags - options.names


NOT_RUN = re.compile(r"^\s*<!-- not run: (?P<reason>.+?) -->\s*$")


def test_torchrun_lines_of_install_blocks_parse(parse_only) -> None:
    """The blocks left not run (they install packages) may also start the recipe: those
    torchrun lines (from the virtualenv they made) parse as the tested ones do."""
    from torch.distributed.run import get_args_parser

    seen = 0
    for path in docs.DOCS:
        for _, before, body in docs.code_blocks(path.read_text(encoding="utf-8")):
            if not NOT_RUN.match(before):
                continue
            for argv in docs.commands("\n".join(body)):
                if Path(argv[0]).name != "torchrun":
                    continue
                with pytest.raises(Parsed) as parsed:
                    get_args_parser().parse_args(argv[1:])
                run = parsed.value.args[0]
                _script_parses(parse_only, run.training_script, run.training_script_args)
                seen += 1
    assert seen >= 2
