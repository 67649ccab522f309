"""``mindspore_or_skip()``, ``required_or_skip(reason)``: the mindformers tests need MindSpore (and
some the real mindformers 2.1.0 package). Inside the ``mindformers`` nox session
(``HP_CP_REQUIRE_BACKEND`` contains ``mindformers``) anything missing FAILS the test; elsewhere it
is skipped with the reason."""

from __future__ import annotations

import os
from types import ModuleType

import pytest


def required() -> bool:
    """Whether ``HP_CP_REQUIRE_BACKEND`` asks for the mindformers backend."""
    return "mindformers" in os.environ.get("HP_CP_REQUIRE_BACKEND", "").split(",")


def required_or_skip(reason: str) -> None:
    """Skip with ``reason``, or fail with it when the mindformers backend is required."""
    if required():
        pytest.fail(
            f"HP_CP_REQUIRE_BACKEND asks for the mindformers backend but {reason}. The nox "
            "session `mindformers` installs everything needed.",
            pytrace=False,
        )
    pytest.skip(reason)


def mindspore_or_skip() -> ModuleType:
    try:
        import mindspore
    except ImportError as exc:
        msg = f"MindSpore cannot be imported ({type(exc).__name__}: {exc})"
        if required():
            pytest.fail(
                f"HP_CP_REQUIRE_BACKEND asks for the mindformers backend but {msg}. Install "
                "`mindspore==2.10.0 'numpy<2'` (the nox session `mindformers` does).",
                pytrace=False,
            )
        pytest.skip(msg, allow_module_level=True)
    return mindspore
