"""Pipeline parallel x CP x recomputation (``torch.distributed.pipelining``).

transformers' DeepSeek V4 and GLM-5 cut by hand into stages, each stage under ``enable_cp``
on its row of a ``(pp, cp)`` mesh, every layer recomputed (non-reentrant: torch's stages take
input gradients with ``torch.autograd.grad(inputs=...)``, which a reentrant checkpoint
refuses, with or without CP); ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``
and ``ScheduleInterleavedZeroBubble`` (two stages per rank; the zero-bubble one splits each
backward into input and weight gradients) with 4 micro-batches, two steps of other real
lengths: every gradient equals the whole model's on one process on the global batch. Three
gloo jobs: pp 2 x cp 2 (load-balanced), pp 2 x cp 3 (contiguous), pp 2 x dp 2 x cp 2 with
FSDP2 over each stage's flattened (dp, cp).
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


FSDP = [("glm_moe_dsa", "1f1b", 2, "load_balanced", False)]
"""On a ``(pp 2, dp 2, cp 2)`` mesh, FSDP2 over the flattened ``(dp, cp)`` of each stage."""
JOBS = ((CP2, 4, "pp2xcp2"), (CP3, 6, "pp2xcp3"), (FSDP, 8, "pp2xdp2xcp2-fsdp2"))
CASES = [(mesh, case) for cases, _, mesh in JOBS for case in cases]


@pytest.fixture(scope="module")
def results() -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for cases, world, mesh in JOBS:
        for rank_results in run_ranks(world, pc.pipeline_suite, cases, timeout=1200):
            for r in rank_results:
                out.setdefault((mesh, r.get("case", "cut_group")), []).append(r)
    return out


def _name(job: tuple) -> str:
    mesh, (kind, schedule, _, layout, reentrant) = job
    mode = "reentrant" if reentrant else "nonreentrant"
    return f"{kind}-{schedule}-{mesh}-{layout}-{mode}"


@pytest.mark.parametrize("job", CASES, ids=_name)
def test_pipeline_stages_under_cp_equal_one_process(results: dict, job: tuple) -> None:
    ranks = results[job]
    world = {mesh: w for _, w, mesh in JOBS}[job[0]]
    assert len(ranks) == world  # every rank of the mesh reported
    for got in ranks:
        assert got["params_checked"] > 0, got
        assert got["grad_err"] <= GRAD_RTOL, got
        # flat from step to step: what is left after a step is what the stages keep of its
        # micro-batches until the next one (their outputs' graphs), never more
        live = got["live_records"]
        assert live == [live[0]] * len(live), got
        assert live[0] <= got["stages"] * (pc.MICRO_BATCHES + 1), got


def test_a_stage_cutting_a_shared_group_is_refused(results: dict) -> None:
    for got in results["pp2xcp2", "cut_group"]:
        assert "reuses 'selection'" in got["cut_group"], got
        assert "no earlier layer makes it" in got["cut_group"], got
