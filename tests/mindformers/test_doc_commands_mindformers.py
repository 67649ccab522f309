"""The MindFormers recipe's command lines on README.md and docs/mindformers.md parse with the
real parsers (``nox -s mindformers``): msrun's own (MindSpore's ``get_args``) and the
recipe's; the one-process run, the cp 2 run checked against it and saved, the cp 4 run
resumed from it. The ``example_mindformers`` suite runs these commands."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


docs = SimpleNamespace(**runpy.run_path(str(ROOT / "tests" / "doc_blocks.py")))


Parsed = docs.Parsed


@pytest.mark.parametrize("name", ["readme-mindformers-recipe", "mindformers-recipe-commands"])
def test_the_recipes_commands_parse(monkeypatch, name: str) -> None:
    from mindspore.parallel.cluster.run import get_args

    docs.parse_only(monkeypatch)
    runs = []
    for argv in docs.commands(docs.block(name)):
        if argv[0] == "msrun":
            monkeypatch.setattr(sys, "argv", argv)
            with pytest.raises(Parsed) as parsed:
                get_args()
            msrun = parsed.value.args[0]
            assert msrun.worker_num == msrun.local_worker_num
            script, args, cp = msrun.task_script, msrun.task_script_args, msrun.worker_num
        else:
            assert argv[0] == "python", argv
            script, args, cp = argv[1], argv[2:], 1
        assert script == "examples/train_mindformers_cp.py", script
        monkeypatch.setattr(sys, "argv", [script, *args])
        with pytest.raises(Parsed) as parsed:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        runs.append((cp, parsed.value.args[0]))
    assert [cp for cp, _ in runs] == [1, 2, 4]
    one, two, four = (a for _, a in runs)
    assert (one.steps, two.steps, four.steps) == (3, 2, 3)
    assert one.losses == two.expect == four.expect and two.save == four.resume
