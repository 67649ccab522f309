"""``mindspore_or_skip()``: the mindformers tests need MindSpore. Inside the ``mindformers`` nox
session (``HP_CP_REQUIRE_BACKEND`` contains ``mindformers``) a missing MindSpore FAILS the module;
elsewhere the module is skipped with the reason."""

from __future__ import annotations

import os
from types import ModuleType

import pytest


def mindspore_or_skip() -> ModuleType:
    try:
        import mindspore
    except ImportError as exc:
        msg = f"MindSpore cannot be imported ({type(exc).__name__}: {exc})"
        if "mindformers" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
            pytest.fail(
                f"HP_CP_REQUIRE_BACKEND asks for the mindformers backend but {msg}. Install "
                "`mindspore==2.10.0 'numpy<2'` (the nox session `mindformers` does).",
                pytrace=False,
            )
        pytest.skip(msg, allow_module_level=True)
    return mindspore
