"""The contract every installed backend meets, one suite parametrised over them.

For each backend (``fake`` always; ``torch`` and ``mindformers`` when installed; see
``conftest.py`` for ``HP_CP_REQUIRE_BACKEND``): a small layer of that backend under CP with
cp 1, 2 and 3, r 0, 4 and 128, padded/contiguous and packed/load-balanced equals its
single-device run; one forward makes one halo exchange and at most one all-gather (none at
all for cp = 1); ``handle.stats()`` reports bytes; ``disable_cp`` restores the module; the
backend's hooks decline a module they do not own.
"""

from __future__ import annotations

import pytest
from contract_drivers import (
    CASES,
    KNOWN_BACKENDS,
    ContractCase,
    backend_status,
    required_backends,
)

from hp_cp_core.plugins import PluginHost

pytestmark = pytest.mark.slow


def _results(driver, case: ContractCase) -> list[dict]:
    got = driver.run()
    if isinstance(got, BaseException):
        raise AssertionError(f"the {driver.name} contract job failed: {got}") from got
    per_rank = got[case]
    if isinstance(per_rank, str):
        raise AssertionError(per_rank)
    return per_rank


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cp_equals_single_device(driver, case: ContractCase) -> None:
    per_rank = _results(driver, case)
    assert len(per_rank) == case.cp
    driver.check(case, per_rank)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_one_halo_exchange_at_most_one_all_gather(driver, case: ContractCase) -> None:
    for res in _results(driver, case):
        stats = res["stats"]
        assert isinstance(stats["bytes_sent"], int) and isinstance(stats["bytes_recv"], int)
        assert stats["backend"] == driver.name and stats["cp_size"] == case.cp
        halo, gathers = driver.counts(stats)
        if case.cp == 1:
            assert (halo, gathers) == (0, 0), stats
            assert stats["bytes_sent"] == stats["bytes_recv"] == 0, stats
        else:
            assert halo == 1, stats
            assert gathers == (1 if case.r else 0), stats
        assert res["restored"], "disable_cp did not restore the module"
    if case.cp > 1:
        assert sum(r["stats"]["bytes_recv"] for r in _results(driver, case)) > 0


class Foreign:
    """A module no backend owns."""


def test_hooks_decline_foreign_modules(backend_name: str) -> None:
    host = PluginHost()
    plugin = host.pm.get_plugin(backend_name)
    assert plugin is not None
    answers = {}
    for caller in host.pm.get_hookcallers(plugin):
        impl = next(i for i in caller.get_hookimpls() if i.plugin_name == backend_name)
        kwargs = {arg: None for arg in impl.argnames}
        kwargs["module"] = Foreign()
        answers[caller.name] = impl.function(**kwargs)
    assert "hp_cp_backend" in answers
    assert all(v is None for v in answers.values()), answers


def test_required_backends_are_installed() -> None:
    """Every backend named in HP_CP_REQUIRE_BACKEND is installed (other names there, such as
    ``transformers``, belong to other suites)."""
    for name in sorted(required_backends() & set(KNOWN_BACKENDS)):
        why = backend_status(name)
        assert why is None, f"required backend {name!r}: {why}"
