"""The REAL mindformers 2.1.0 ``PyNativeDeepseekV4ForCausalLM`` (tiny: sliding-window, CSA and HCA
layers, MoE, hyper-connections, one MTP layer) trains under hp_cp on msrun ranks (MindSpore
CPU): cp = 4 on the world group and cp = 2 on two sub-groups, in ONE msrun job of 4 ranks
(``mf_model_msrun_worker.py``, run after the real cell's cases in their job:
``mf_msrun_job.run_real_job``). Every case is compared with the same model run on one device in
the same job: the loss, the logits and every parameter gradient (summed over the CP ranks).
"""

from __future__ import annotations

import importlib.util

import pytest
from mf_model_cases import (
    GRAD_SCALE_TOL,
    GRAD_TOL,
    LOGITS_TOL,
    LOSS_TOL,
    ModelCase,
    checking_rank,
    indexer_param,
    model_cases,
)
from mf_msrun_job import REAL_WORLD, case_reports, run_real_job
from mf_require import mindspore_or_skip, required_or_skip

mindspore_or_skip()

pytestmark = [pytest.mark.slow, pytest.mark.real_mindformers]

WORLD = REAL_WORLD
CASES = model_cases()


@pytest.fixture(scope="module")
def job() -> dict:
    for need in ("mindformers", "yaml", "regex", "deprecated"):
        if importlib.util.find_spec(need) is None:
            required_or_skip(
                f"`{need}` is not installed (mindformers==2.1.0 --no-deps, pyyaml, regex, "
                "deprecated)"
            )
    return run_real_job()["model"]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_whole_model_under_cp_matches_one_device(job: dict, case: ModelCase) -> None:
    per_rank = case_reports(job, case, case.ranks())
    for res in per_rank:
        assert res["cp_size"] == case.cp
        assert res["wrapped_rope"] == 4 and res["restored_rope"], res  # 3 decoder + 1 MTP
        assert res["wrapped_mtp"] == 1 and res["restored_mtp"], res  # the MTP token shift
        assert res["routers_cp"] == [case.cp] and res["routers_cp_after"] == [1], res  # aux
        assert res["stats"]["bytes_sent"] > 0
    first = per_rank[case.ranks().index(checking_rank(case))]
    assert first["zero_ref_grads"] == [], first["zero_ref_grads"]  # every weight is reached
    assert first["loss_err"] <= LOSS_TOL, (first["loss_cp"], first["loss_ref"])
    assert first["logits_err"] <= LOGITS_TOL, first["logits_err"]
    assert len(first["grad_err"]) > 110  # every parameter, the MTP layer's included
    # "odd" pads 133 rows to fit: the indexer parameters' gradients then prove the padding
    # rows stay out of the indexer KL loss (the cell takes no loss mask; the handle knows
    # what handle.shard(..., pad_value=) appended)
    assert any(indexer_param(k) for k in first["grad_err"])
    assert any(k.startswith("mtp.") for k in first["grad_err"])  # MTP under CP too
    bad = bad_gradients(first)
    assert not bad, bad


def test_a_per_rank_mean_mtp_loss_is_refused_on_every_rank(job: dict) -> None:
    for rank in range(WORLD):
        got = job["reports"][rank]["mean_mtp_loss_refused"]
        assert got["error"] and "calculate_per_token_loss=False" in got["error"], got
        assert got["installed_after"] == got["installed_before"], got  # nothing half-done


def bad_gradients(first: dict) -> dict:
    """Gradients off by more than ``GRAD_TOL`` (relative) and ``GRAD_SCALE_TOL`` (over the
    model's largest gradient)."""
    scaled = first["grad_err_over_model_scale"]
    return {
        k: e for k, e in first["grad_err"].items() if e > GRAD_TOL and scaled[k] > GRAD_SCALE_TOL
    }


def test_model_grid_covers_the_issue() -> None:
    for cp in (2, 4):
        mine = [c for c in CASES if c.cp == cp]
        assert {c.layout for c in mine} == {"contiguous", "load_balanced"}
        assert {"padded", "odd"} <= {c.data for c in mine}  # odd: packed, needs padding
    assert {c.part for c in CASES if c.cp == 2} == {0, 1}  # both sub-groups at work
