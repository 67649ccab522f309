"""A plugin declaring a backend API this core does not know (``python -m hp_cp_core`` lists it
as unusable; ``enable_cp`` refuses it)."""

from __future__ import annotations

from typing import Any

from hp_cp_core import hookimpl
from hp_cp_fake.fake_backend import BACKEND


class FutureLayer:
    """A module only this plugin claims."""


@hookimpl
def hp_cp_backend_api() -> str:
    return "1.0"


@hookimpl
def hp_cp_backend(module: Any) -> Any:
    return BACKEND if isinstance(module, FutureLayer) else None
