"""0.4's module paths still import after 0.5 grouped the modules into folders, and each gives
the very module at its new home (Note [Old import paths] in ``hp_cp_torch._compat``)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from hp_cp_torch._compat import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_home(old: str) -> None:
    module = importlib.import_module(f"hp_cp_torch.{old}")
    assert module is importlib.import_module(MOVED[old])
    assert module.__name__ == MOVED[old]
    assert getattr(importlib.import_module("hp_cp_torch"), old) is module


def test_old_paths_first_in_a_fresh_process_give_one_class_and_one_registry() -> None:
    """Imported before anything else (as a 0.4 adapter does), the old path is no copy: the
    spec's class is the package's, and a model registered through the old registry path is
    the one the new path finds."""
    code = (
        "from hp_cp_torch.model_adapter import ModelAdapter\n"
        "import hp_cp_torch.model_registry as old, hp_cp_torch.runner as runner\n"
        "import hp_cp_torch, hp_cp_torch.model.registry as new, hp_cp_torch.model.runner\n"
        "assert ModelAdapter is hp_cp_torch.ModelAdapter\n"
        "assert old is new and runner is hp_cp_torch.model.runner\n"
        "class Attention: pass\n"
        "class Adapter(ModelAdapter, abstract=True): pass\n"
        "old.register_model_adapter(Attention, Adapter)\n"
        "assert new.adapter_class_for(Attention()) is Adapter\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_new_paths_are_the_documented_ones() -> None:
    """Nothing outside ``_compat`` answers to an old name by itself: each moved module was
    moved, not copied (a second file at the old place would shadow the alias)."""
    from pathlib import Path

    import hp_cp_torch

    top = Path(hp_cp_torch.__file__).parent
    assert [old for old in MOVED if (top / f"{old}.py").exists()] == []
    assert all((top / "_compat" / f"{old}.py").is_file() for old in MOVED)
