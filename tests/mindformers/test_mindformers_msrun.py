"""CP on real MindSpore processes: cp = 2 and 4 started with ``msrun`` on CPU.

One msrun job per world size runs every case of ``mf_cases.parity_cases`` (start-up costs
10-30 s, so cases are grouped); each case is then checked here from the ranks' JSON reports:
output rows within 1e-5 relative of the single-device cell, input gradients (the rank's rows)
and parameter gradients (summed over the CP ranks) within 1e-4, the forward installed and
restored, and the traffic counters.
"""

from __future__ import annotations

import os

import pytest
from mf_cases import Case, parity_cases
from mf_msrun_job import assert_parity, case_reports, run_msrun
from mf_require import mindspore_or_skip

mindspore_or_skip()

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mf_msrun_worker.py")
WORLDS = (2, 4)
TIMEOUT_S = {2: 900, 4: 1500}


def run_job(world: int) -> dict:
    return run_msrun(WORKER, world, TIMEOUT_S[world])


def _case_reports(world: int, case: Case) -> list[dict]:
    return case_reports(run_job(world), case, list(range(world)))


PARAMS = [pytest.param(w, c, id=c.name) for w in WORLDS for c in parity_cases(w)]


@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_cp_matches_single_device(world: int, case: Case) -> None:
    assert_parity(case, _case_reports(world, case))


def test_grid_covers_the_issue() -> None:
    cases = [c for w in WORLDS for c in parity_cases(w)]
    for cp in WORLDS:
        grid = {(c.r, c.layout, c.packed) for c in cases if c.cp == cp and not c.subgroup}
        assert len(grid) == 12
    assert any(c.train for c in cases) and any(c.subgroup for c in cases)
    assert any(c.emulate for c in cases) and any(c.mesh == "object" for c in cases)
    # L < W - 1 (window halo from two ranks back) and runs shorter than r
    assert any(c.cp == 4 and c.r == 4 and c.seq // c.cp < 7 for c in cases)
    assert any(c.r == 128 and c.seq // c.cp < 128 for c in cases)
