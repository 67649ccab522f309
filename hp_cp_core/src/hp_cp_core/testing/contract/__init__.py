"""The hp_cp contract suite as a pytest plugin: ``pytest -p hp_cp_core.testing.contract``.

Loaded with ``-p``, the plugin adds the suite (``test_contract.py`` next to this file) to
what pytest collects, and runs it for every backend whose driver is installed under the
entry-point group ``hp_cp.contract`` (:mod:`hp_cp_core.testing.cases` says what a driver
does). Options:

* ``--hp-cp-backend=jax,fake``: only these backends (default: every installed driver);
* ``--hp-cp-max-cp=N``: CP groups of at most N ranks (default: each driver's ``max_cp``);
* ``--hp-cp-require=jax`` (or ``HP_CP_REQUIRE_BACKEND=jax``): fail, rather than skip, when
  that backend or its driver is missing, so a CI job cannot pass by testing nothing.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path
from typing import Any

import pytest

from hp_cp_core.testing.cases import DRIVER_ENTRY_POINT_GROUP, ContractCase, contract_cases

SUITE = Path(__file__).with_name("test_contract.py")
REQUIRE_ENV = "HP_CP_REQUIRE_BACKEND"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hp_cp", "hp_cp contract suite")
    group.addoption("--hp-cp-backend", default="", help="comma list of backends to test")
    group.addoption("--hp-cp-max-cp", type=int, default=0, help="largest CP group")
    group.addoption(
        "--hp-cp-require", default="", help=f"backends that must be tested (or ${REQUIRE_ENV})"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hp_cp_contract: a case of the hp_cp contract suite")
    suite = str(SUITE)
    if suite not in config.args and str(SUITE.parent) not in config.args:
        if config.args_source == pytest.Config.ArgsSource.ARGS:
            config.args.append(suite)
        else:  # no path given: the suite alone, not the project's testpaths
            config.args[:] = [suite]


def _names(text: str) -> set[str]:
    return {n.strip() for n in text.split(",") if n.strip()}


def required_backends(config: pytest.Config) -> set[str]:
    return _names(config.getoption("--hp-cp-require")) | _names(os.environ.get(REQUIRE_ENV, ""))


def driver_entry_points() -> dict[str, Any]:
    """Installed drivers by backend name (entry points, not loaded)."""
    return {ep.name: ep for ep in md.entry_points(group=DRIVER_ENTRY_POINT_GROUP)}


def selected_backends(config: pytest.Config) -> list[str]:
    chosen = _names(config.getoption("--hp-cp-backend"))
    names = set(driver_entry_points()) | required_backends(config)
    return sorted(names & chosen if chosen else names)


class Drivers:
    """The loaded drivers and their (cached) runs for one pytest session."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.eps = driver_entry_points()
        self._drivers: dict[str, Any] = {}
        self._runs: dict[str, Any] = {}

    def unavailable(self, name: str, why: str) -> None:
        if name in required_backends(self.config):
            pytest.fail(f"backend {name!r} is required ({REQUIRE_ENV}) but {why}", pytrace=False)
        pytest.skip(f"backend {name!r}: {why}")

    def driver(self, name: str) -> Any:
        if name not in self._drivers:
            ep = self.eps.get(name)
            if ep is None:
                self.unavailable(name, f"no {DRIVER_ENTRY_POINT_GROUP!r} entry point is installed")
            self._drivers[name] = ep.load()()
        return self._drivers[name]

    def max_cp(self, name: str) -> int:
        limit = self.config.getoption("--hp-cp-max-cp")
        return min(self.driver(name).max_cp, limit) if limit else self.driver(name).max_cp

    def cases(self, name: str) -> list[ContractCase]:
        return contract_cases(self.max_cp(name))

    def reports(self, name: str, case: ContractCase) -> list[dict]:
        if name not in self._runs:
            try:
                self._runs[name] = self.driver(name).run(self.cases(name))
            except Exception as exc:  # noqa: BLE001 - reported by every case
                self._runs[name] = exc
        got = self._runs[name]
        if isinstance(got, BaseException):
            raise AssertionError(f"the {name} driver's run failed: {got!r}") from got
        per_rank = got.get(case.name)
        if per_rank is None:
            raise AssertionError(f"the {name} driver reported nothing for {case.name}")
        if isinstance(per_rank, str):
            raise AssertionError(f"{name} {case.name}: {per_rank}")
        return list(per_rank)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "contract_backend" not in metafunc.fixturenames:
        return
    names = selected_backends(metafunc.config)
    if "contract_case" in metafunc.fixturenames:
        family = getattr(metafunc.function, "families", None)
        pairs = []
        for name in names:
            ep = driver_entry_points().get(name)
            max_cp = metafunc.config.getoption("--hp-cp-max-cp") or 0
            if ep is not None:
                driver_max = int(getattr(ep.load(), "max_cp", 2))
                max_cp = min(driver_max, max_cp) if max_cp else driver_max
            for case in contract_cases(max(max_cp, 1)):
                if family is None or case.family in family:
                    pairs.append((name, case))
        metafunc.parametrize(
            ("contract_backend", "contract_case"), pairs, ids=[f"{n}-{c.name}" for n, c in pairs]
        )
    else:
        metafunc.parametrize("contract_backend", names)


@pytest.fixture(scope="session")
def contract_drivers(request: pytest.FixtureRequest) -> Drivers:
    return Drivers(request.config)
