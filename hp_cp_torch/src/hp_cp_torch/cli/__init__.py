"""The ``hp-cp`` command (:mod:`~hp_cp_torch.cli.commands`, also ``python -m hp_cp_torch.cli``),
its demo (:mod:`~hp_cp_torch.cli.demo`) and the in-process launcher of gloo ranks that the demo,
the benchmarks and the tests use (:mod:`~hp_cp_torch.cli.launch`).

The names of the 0.1 module ``hp_cp_torch.cli`` (now :mod:`~hp_cp_torch.cli.commands`) are
still read here, with a ``DeprecationWarning``; removed in 0.3.
"""

from __future__ import annotations

from typing import Any

from hp_cp_torch._moved import moved_attribute


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, name, "hp_cp_torch.cli.commands")
