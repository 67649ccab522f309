"""The REAL mindformers 2.1.0 ``CompressedSparseAttention`` under CP on msrun ranks (MindSpore CPU),
training mode with the indexer KL loss: cp = 4 on the world group and cp = 2 on two sub-groups,
in ONE msrun job of 4 ranks (``mf_real_msrun_worker.py``; the whole-model cases of
``test_real_mindformers_model_msrun.py`` run after them in the same job). Every case is compared
with the same real cell run on one device in the same job: output rows, the logged indexer loss
(mindformers' indexer-loss tracker), input gradients and every parameter gradient (summed over
the CP ranks).

``nox -s mindformers -- -m real_mindformers`` runs exactly these tests.
"""

from __future__ import annotations

import importlib.util

import pytest
from mf_cases import Case, real_cases
from mf_msrun_job import REAL_WORLD, assert_parity, case_reports, run_real_job
from mf_require import mindspore_or_skip, required_or_skip

mindspore_or_skip()

pytestmark = [pytest.mark.slow, pytest.mark.real_mindformers]

WORLD = REAL_WORLD
CASES = real_cases()


def _ranks(case: Case) -> list[int]:
    if case.part < 0:
        return list(range(WORLD))
    return list(range(case.part * case.cp, (case.part + 1) * case.cp))


@pytest.fixture(scope="module")
def job() -> dict:
    for need in ("mindformers", "yaml", "regex", "deprecated"):
        if importlib.util.find_spec(need) is None:
            required_or_skip(
                f"`{need}` is not installed (mindformers==2.1.0 --no-deps, pyyaml, regex, "
                "deprecated)"
            )
    return run_real_job()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_real_cell_under_cp_matches_one_device(job: dict, case: Case) -> None:
    per_rank = case_reports(job, case, _ranks(case))
    assert_parity(case, per_rank)
    if case.r == 4:  # the loss the real cell logs: a real KL value, the same on every rank
        assert all(res["loss_ref"] > 0 for res in per_rank)


def test_real_grid_covers_the_issue() -> None:
    for cp in (2, 4):
        grid = {(c.r, c.layout, c.packed) for c in CASES if c.cp == cp}
        assert len(grid) == 12, cp
    assert all(c.real and c.train for c in CASES)
    local = {(c.cp, c.r): c.seq // c.cp for c in CASES}
    assert local[(2, 4)] % 4 and local[(4, 4)] % 4 and local[(2, 128)] % 128  # L % r != 0
    assert local[(4, 4)] < 7 and local[(4, 128)] < 128  # L < W - 1, L < r
    assert {c.part for c in CASES if c.cp == 2} == {0, 1}  # both sub-groups at work


def test_all_gather_into_tensor_standin_matches_its_formula(job: dict) -> None:
    """The one stand-in that needs ranks (``mf_cpu_standins.all_gather_into_tensor``), checked
    in the same job on every rank: rank-major concatenation, summed own-slice gradient."""
    assert sorted(job["reports"]) == list(range(WORLD)), job["dir"]
    for rank, rep in job["reports"].items():
        got = rep["standin_all_gather_into_tensor"]
        assert got["forward_err"] == 0.0 and got["backward_err"] <= 1e-6, (rank, got)
