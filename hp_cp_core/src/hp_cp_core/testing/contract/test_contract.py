"""The contract every hp_cp backend meets, run through its driver (``hp_cp.contract``).

Per backend: CP equals one device (outputs and gradients) for cp 1..max_cp, r 0 / 4 / 128,
contiguous padded and load-balanced packed inputs, and for ranks that own no compressed slot
(L < r, 0-row compressor outputs); every rank runs the same collectives in the same order,
backward included; a bad input on one rank raises ``HpCpError`` on every rank; ``stats()``
has the one schema of :mod:`hp_cp_core.stats` and counts one halo exchange and at most one
all-gather per forward; ``disable_cp`` restores the module; the hooks decline a module they do
not own; discovery imports no framework.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hp_cp_core.plugins import PluginHost
from hp_cp_core.stats import (
    ALL_GATHER,
    ALL_GATHER_BWD,
    HALO_EXCHANGE,
    HALO_EXCHANGE_BWD,
    SLOT_EXCHANGE,
    SLOT_EXCHANGE_BWD,
    check_stats,
)
from hp_cp_core.testing import rel_err
from hp_cp_core.testing.cases import ContractCase

pytestmark = pytest.mark.hp_cp_contract


def families(*names: str):
    def mark(fn):
        fn.families = names
        return fn

    return mark


@families("parity", "owns_nothing")
def test_cp_equals_single_device(contract_drivers, contract_backend, contract_case) -> None:
    driver = contract_drivers.driver(contract_backend)
    reports = contract_drivers.reports(contract_backend, contract_case)
    assert [r["cp_rank"] for r in reports] == list(range(contract_case.cp))
    compared = {}
    for rep in reports:
        for name, (got, want) in rep.get("compare", {}).items():
            compared[f"rank {rep['cp_rank']} {name}"] = rel_err(got, want)
        for name, err in rep.get("rel_err", {}).items():
            compared[f"rank {rep['cp_rank']} {name}"] = float(err)
    assert any(k.endswith(" out") for k in compared), f"no output compared: {sorted(compared)}"
    if driver.differentiable:
        assert any(" grad" in k for k in compared), f"no gradient compared: {sorted(compared)}"
    bad = {k: v for k, v in compared.items() if not v <= driver.rtol}
    assert not bad, f"relative error above rtol={driver.rtol:g}: {bad}"


@families("parity", "owns_nothing")
def test_stats_schema_and_counts(contract_drivers, contract_backend, contract_case) -> None:
    driver = contract_drivers.driver(contract_backend)
    reports = contract_drivers.reports(contract_backend, contract_case)
    gathers = 1 if contract_case.r else 0
    for rep in reports:
        who = f"rank {rep['cp_rank']}"
        fwd, last = rep["stats_forward"], rep["stats"]
        for stats in (fwd, last):
            assert not check_stats(stats), (who, check_stats(stats))
            assert stats["backend"] == contract_backend, (who, stats)
            assert stats["cp_size"] == contract_case.cp, (who, stats)
        calls = fwd["collectives"]
        slots = calls.get(ALL_GATHER, 0) + calls.get(SLOT_EXCHANGE, 0)
        if contract_case.cp == 1:  # a group of one may skip (and not count) its exchanges
            assert calls.get(HALO_EXCHANGE, 0) <= 1 and slots <= gathers, (who, calls)
            assert fwd["bytes_sent"] == fwd["bytes_recv"] == 0, (who, "a group of one", fwd)
        else:
            assert calls.get(HALO_EXCHANGE) == 1, (who, "one halo exchange per forward", calls)
            assert slots == gathers, (who, "one slot collective per forward with r > 0", calls)
        if driver.differentiable and contract_case.cp > 1:
            calls = last["collectives"]
            slots = calls.get(ALL_GATHER_BWD, 0) + calls.get(SLOT_EXCHANGE_BWD, 0)
            assert calls.get(HALO_EXCHANGE_BWD) == 1, (who, "halo backward on every rank", calls)
            assert slots == gathers, (who, "slot collective backward on every rank", calls)
        assert rep["restored"], f"{who}: disable_cp did not restore the module"
    if contract_case.cp > 1:
        assert sum(r["stats_forward"]["bytes_recv"] for r in reports) > 0


@families("parity", "owns_nothing")
def test_same_collectives_in_same_order(contract_drivers, contract_backend, contract_case):
    """Backward order: every rank enters the same collectives in the same order."""
    reports = contract_drivers.reports(contract_backend, contract_case)
    traces = [r.get("trace") for r in reports]
    if any(t is None for t in traces):
        pytest.skip(f"the {contract_backend} driver reports no collective trace")
    for rep, trace in zip(reports, traces):
        assert trace == traces[0], (
            f"rank {rep['cp_rank']} ran {trace}, rank {reports[0]['cp_rank']} ran {traces[0]}"
        )
    if contract_drivers.driver(contract_backend).differentiable and contract_case.cp > 1:
        assert HALO_EXCHANGE_BWD in traces[0], traces[0]


@families("bad_input")
def test_bad_input_on_one_rank_raises_on_every_rank(
    contract_drivers, contract_backend, contract_case
) -> None:
    reports = contract_drivers.reports(contract_backend, contract_case)
    assert [r["cp_rank"] for r in reports] == list(range(contract_case.cp))
    for rep in reports:
        assert "error" in rep, f"rank {rep['cp_rank']} raised nothing for a bad input on a peer"
        assert "HpCpError" in rep["error_types"], (rep["cp_rank"], rep["error"])


class Foreign:
    """A module no backend owns."""


def test_hooks_decline_foreign_modules(contract_drivers, contract_backend) -> None:
    contract_drivers.driver(contract_backend)  # skips / fails when there is no driver
    host = PluginHost(autoload=True)
    status = host.statuses.get(contract_backend)
    assert status is not None and status.ok, f"the {contract_backend} plugin: {status}"
    assert status.api_status in ("current", "adapted"), (
        f"the {contract_backend} plugin declares backend API {status.backend_api!r}, which this "
        "hp-cp-core cannot run (hp_cp_backend_api; CHANGELOG.md)"
    )
    plugin = host.pm.get_plugin(contract_backend)
    answers = {}
    for caller in host.pm.get_hookcallers(plugin):
        impl = next(i for i in caller.get_hookimpls() if i.plugin_name == contract_backend)
        if "module" not in impl.argnames:
            continue  # hp_cp_backend_api describes the plugin, not a module
        kwargs = {arg: None for arg in impl.argnames}
        kwargs["module"] = Foreign()
        answers[caller.name] = impl.function(**kwargs)
    assert "hp_cp_backend" in answers
    assert all(v is None for v in answers.values()), answers


DISCOVERY = textwrap.dedent(
    """
    import importlib.metadata as md, json, sys
    from hp_cp_core.plugins import PluginHost
    host = PluginHost(autoload=True)
    ep = {e.name: e for e in md.entry_points(group="hp_cp.contract")}[sys.argv[1]]
    driver = ep.load()()
    print(json.dumps({"framework": driver.framework,
                      "statuses": {n: s.ok for n, s in host.statuses.items()},
                      "modules": sorted({m.split(".")[0] for m in sys.modules})}))
    """
)


def test_no_framework_import_at_discovery(contract_drivers, contract_backend) -> None:
    """Discovering every plugin and loading this backend's driver import no framework."""
    contract_drivers.driver(contract_backend)
    proc = subprocess.run(
        [sys.executable, "-c", DISCOVERY, contract_backend],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["statuses"].get(contract_backend), got["statuses"]
    if got["framework"]:
        assert got["framework"] not in got["modules"], (
            f"discovery imported {got['framework']}: import it inside your hooks, after "
            "checking sys.modules (see the backend guide)"
        )


def test_case_names_are_unique() -> None:
    from hp_cp_core.testing.cases import contract_cases

    names = [c.name for c in contract_cases(8)]
    assert len(names) == len(set(names))
    assert all(isinstance(c, ContractCase) for c in contract_cases(1))
