"""Pipeline parallel x CP x recomputation (``torch.distributed.pipelining``): transformers'
DeepSeek V4 and GLM-5 cut by hand into stages, each stage under ``enable_cp`` on its row of
a ``(pp, cp)`` mesh, every layer recomputed (non-reentrant: torch's stages take input
gradients with ``torch.autograd.grad(inputs=...)``, which a reentrant checkpoint refuses, with
or without CP), ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` (two
stages per rank; the zero-bubble one splits each backward into input and weight gradients) with 4 micro-batches,
two steps of other real lengths: every gradient equals the whole model's on one process on
the global batch. Two gloo jobs: pp 2 x cp 2 (load-balanced), pp 2 x cp 3 (contiguous).
"""

from __future__ import annotations

import os

import pytest

if "transformers" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import transformers.models.glm_moe_dsa  # noqa: F401 - must be importable: fail, not skip
else:
    pytest.importorskip("transformers.models.glm_moe_dsa", exc_type=ImportError)

import pipeline_cases as pc  # noqa: E402 - after the skip
from dist_utils import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

GRAD_RTOL = 1e-4
CP2 = [
    ("glm_moe_dsa", "gpipe", 2, "load_balanced", False),
    ("glm_moe_dsa", "1f1b", 2, "load_balanced", False),
    ("glm_moe_dsa", "interleaved_1f1b", 2, "load_balanced", False),
    ("deepseek_v4", "1f1b", 2, "load_balanced", False),
    ("deepseek_v4", "interleaved_1f1b", 2, "load_balanced", False),
    ("glm_moe_dsa", "interleaved_zero_bubble", 2, "load_balanced", False),
]
CP3 = [
    ("glm_moe_dsa", "1f1b", 3, "contiguous", False),
    ("deepseek_v4", "gpipe", 3, "contiguous", False),
]


@pytest.fixture(scope="module")
def results() -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for cases, world in ((CP2, 4), (CP3, 6)):
        for rank_results in run_ranks(world, pc.pipeline_suite, cases, timeout=1200):
            for r in rank_results:
                out.setdefault(r.get("case", "cut_group"), []).append(r)
    return out


def _name(case: tuple) -> str:
    kind, schedule, cp, layout, reentrant = case
    mode = "reentrant" if reentrant else "nonreentrant"
    return f"{kind}-{schedule}-pp2xcp{cp}-{layout}-{mode}"


@pytest.mark.parametrize("case", CP2 + CP3, ids=_name)
def test_pipeline_stages_under_cp_equal_one_process(results: dict, case: tuple) -> None:
    ranks = results[case]
    assert len(ranks) == 2 * case[2]  # every rank of the (pp, cp) mesh reported
    for got in ranks:
        assert got["params_checked"] > 0, got
        assert got["grad_err"] <= GRAD_RTOL, got


def test_a_stage_cutting_a_shared_group_is_refused(results: dict) -> None:
    for got in results["cut_group"]:
        assert "reuses 'selection'" in got["cut_group"], got
        assert "no earlier layer makes it" in got["cut_group"], got
