"""The 0.1 module paths that moved into subpackages in 0.2, kept for one release.

Each old flat module (``hp_cp_torch/banded.py`` ...) is a two-line shim calling
:func:`alias_module`: importing it warns (``DeprecationWarning`` naming the new path) and
gives the new module itself, so every name (private ones too) is the same object. The two old
modules whose names are now packages (``hp_cp_torch.bench``, ``hp_cp_torch.cli``) read their old
names through :func:`moved_attribute` from the package's ``__getattr__``. All go in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys
import warnings
from typing import Any

MOVED_MODULES = {
    "hp_cp_torch.banded": "hp_cp_torch.kernels.banded",
    "hp_cp_torch.efficient": "hp_cp_torch.kernels.efficient",
    "hp_cp_torch.triton_attention": "hp_cp_torch.kernels.triton_attention",
    "hp_cp_torch.triton_kernels": "hp_cp_torch.kernels.triton_kernels",
    "hp_cp_torch.bench_hotpath": "hp_cp_torch.bench.hotpath",
    "hp_cp_torch.bench_kernel": "hp_cp_torch.bench.kernel",
    "hp_cp_torch.bench_memory": "hp_cp_torch.bench.memory",
    "hp_cp_torch.bench_scaling": "hp_cp_torch.bench.scaling",
    "hp_cp_torch.bench_traffic": "hp_cp_torch.bench.traffic",
    "hp_cp_torch.demo": "hp_cp_torch.cli.demo",
    "hp_cp_torch.launch": "hp_cp_torch.cli.launch",
}
"""Old module path -> new one (the shims; ``hp_cp_torch.bench`` and ``hp_cp_torch.cli`` are
packages now, their old names moved to ``hp_cp_torch.bench.suite`` / ``.cli.commands``)."""


def _message(old: str, new: str) -> str:
    return f"`{old}` moved to `{new}` in hp-cp-torch 0.2; the old path is removed in 0.3."


def alias_module(name: str, new: str) -> None:
    """Run from the old module ``name``: warn, then make ``name`` the new module ``new``
    (``python -m OLD`` runs ``new`` as the main module)."""
    if name == "__main__":
        old = sys.modules["__main__"].__spec__.name
        warnings.warn(_message(old, new), DeprecationWarning, stacklevel=2)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    # 3: the importing line (warnings skips the import machinery's frames)
    warnings.warn(_message(name, new), DeprecationWarning, stacklevel=3)
    sys.modules[name] = importlib.import_module(new)


def moved_attribute(package: str, name: str, new: str) -> Any:
    """``package.name`` where ``name`` was a name of the 0.1 module ``package`` and now lives
    in the module ``new``: warn and return it. AttributeError for anything else (a dunder, a
    submodule not imported yet, a name ``new`` does not have)."""
    missing = AttributeError(f"module {package!r} has no attribute {name!r}")
    if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise missing
    value = getattr(importlib.import_module(new), name, missing)
    if value is missing:
        raise missing
    warnings.warn(_message(f"{package}.{name}", f"{new}.{name}"), DeprecationWarning, stacklevel=3)
    return value
