"""Which backends the contract suite runs on, and which it must not skip.

``HP_CP_REQUIRE_BACKEND=torch,fake`` (a comma list) turns "backend not installed" into a
failure for the backends it names, so a nox session cannot pass by skipping its own backend.
"""

from __future__ import annotations

import pytest
from contract_drivers import DRIVERS, ENV, KNOWN_BACKENDS, backend_status, required_backends


def _unavailable(name: str, why: str) -> None:
    if name in required_backends():
        pytest.fail(f"backend {name!r} is required ({ENV}) but unavailable: {why}")
    pytest.skip(f"backend {name!r} unavailable: {why}")


@pytest.fixture(params=KNOWN_BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    """Every known backend; skipped when not installed, failed when required."""
    name = request.param
    why = backend_status(name)
    if why is not None:
        _unavailable(name, why)
    return name


@pytest.fixture
def driver(backend_name: str):
    """The contract driver of the backend (see ``contract_drivers.py``)."""
    cls = DRIVERS.get(backend_name)
    if cls is None:
        _unavailable(backend_name, "it is installed but tests/contract has no driver for it")
    return _driver_instance(cls)


_INSTANCES: dict[type, object] = {}


def _driver_instance(cls: type) -> object:
    if cls not in _INSTANCES:
        _INSTANCES[cls] = cls()
    return _INSTANCES[cls]
