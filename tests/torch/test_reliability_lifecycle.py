"""Nothing lost: enable / disable leave the model exactly as it was, a CP model can be saved
and loaded, two CP models on different meshes do not interfere, the plan cache is bounded.

Runs in the same 4-rank job as the determinism cases (``reliability_cases.py``, part ``a``).
"""

from __future__ import annotations

import pytest
from cases import rel_err, result, single_device
from reliability_cases import WORLD

pytestmark = pytest.mark.slow

SUITE = "reliability_cases:reliability_suite:a"
NOT_COPYABLE = "HpCpError: cannot pickle or copy a `{}` while it runs under CP"


def ranks(name: str) -> list[dict]:
    return result(SUITE, WORLD, name)


@pytest.mark.parametrize("name", ["state:r4-lb-packed", "state:r128-contig-padded"])
def test_enable_disable_keep_state_and_forward(name: str) -> None:
    """state_dict keys, order, values and storage, parameters, buffers, sub-modules, hooks and
    instance attributes: unchanged while enabled, after a CP step and after disable; the
    forward is the class's again and the output equals a never-enabled layer bitwise."""
    for r in ranks(name):
        # while enabled: the installed forward, the handle mark and the layer's one adapter
        # (built at install, dropped by disable_cp), nothing else
        want = ["attrs ['_hp_cp_adapter', '_hp_cp_handle', 'forward']"]
        assert r["enabled_diff"] == want, r["enabled_diff"]
        assert r["after_step_diff"] == r["enabled_diff"]
        assert r["disabled_diff"] == [], r["disabled_diff"]
        assert r["forward_is_class_forward"]
        assert r["plain_bitwise"]


@pytest.mark.parametrize("name", ["state:r4-lb-packed", "state:r128-contig-padded"])
def test_save_and_load_under_cp(name: str) -> None:
    """The state_dict of a CP model saves and loads into a fresh model (other weights) that
    runs the same CP step bitwise; after disable the whole module saves, loads and runs
    plain and under CP bitwise like the original."""
    for r in ranks(name):
        assert r["save_state_dict"] == "ok"
        assert r["loaded_step_diff"] == [], r["loaded_step_diff"]
        assert r["torch_save_after_disable"] == "ok"
        assert r["loaded_plain_bitwise"]
        assert r["loaded_module_step_diff"] == [], r["loaded_module_step_diff"]
        assert r["model_layers"] == 1
        assert r["model_disabled_diff"] == [], r["model_disabled_diff"]
        assert r["torch_save_model_after"] == "ok"


@pytest.mark.parametrize("name", ["state:r4-lb-packed", "state:r128-contig-padded"])
def test_whole_module_pickle_under_cp_is_a_clear_error(name: str) -> None:
    """torch.save / deepcopy of a module under CP (a layer or a whole model) raise HpCpError
    saying why and what to do, instead of "Can't pickle local object" or a copy whose forward
    still runs the original's weights."""
    for r in ranks(name):
        for key in ("torch_save_module", "deepcopy_module", "pickle_handle", "torch_save_model"):
            assert r[key].startswith(NOT_COPYABLE.format("DeepSeekV4Attention")), (key, r[key])
            assert "state_dict()" in r[key] and "disable_cp(handle)" in r[key]


def test_patched_module_keeps_no_adapter_after_disable() -> None:
    for r in ranks("adapter_state:r4"):
        assert r["enabled_diff"] == ["attrs ['_hp_cp_adapter', '_hp_cp_handle', 'forward']"]
        assert r["torch_save_module"].startswith(NOT_COPYABLE.format("SeqMajorCSA"))
        assert r["disabled_diff"] == [], r["disabled_diff"]
        assert r["torch_save_after_disable"] == "ok"


def test_two_models_on_different_meshes_do_not_interfere() -> None:
    per_rank = ranks("two_models")
    for k, r in enumerate(per_rank):
        assert r["cp_sizes"] == (4, 2)
        assert r["b_group_ranks"] == ([0, 1] if k < 2 else [2, 3])
        assert r["a_diff"] == [], f"rank {k}: model A interleaved with B differs: {r['a_diff']}"
        assert r["b_diff"] == [], f"rank {k}: model B interleaved with A differs: {r['b_diff']}"
        assert r["restored"]
        for one, two in (r["stats_a"], r["stats_b"]):  # each counts only its own traffic
            assert two["collectives"] == {n: 2 * c for n, c in one["collectives"].items()}
            assert two["bytes_sent"] == 2 * one["bytes_sent"] > 0
            assert two["bytes_recv"] == 2 * one["bytes_recv"]
            assert two["plan_cache"]["plans"] == one["plan_cache"]["plans"] == 1
            assert two["plan_cache"]["misses"] == one["plan_cache"]["misses"]
            assert two["plan_cache"]["hits"] > one["plan_cache"]["hits"]
    # model B (on the two 2-rank groups) matches its single-device run
    want = single_device(per_rank[0]["b_case"])["out"]
    for r in per_rank:
        assert rel_err(r["b_out"], want) <= 1e-5


def test_plan_cache_is_bounded_and_least_recently_used() -> None:
    for r in ranks("plan_cache"):
        small = r["small"]
        assert [s["plans"] for s in small] == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4]
        assert all(s["capacity"] == 4 for s in small)
        # shapes 1..7 miss; 4 hits; 8 misses (evicts 5, not 4); 4 hits; 5 misses
        assert [s["misses"] for s in small] == [1, 2, 3, 4, 5, 6, 7, 7, 8, 8, 9]
        hits = [s["hits"] for s in small]
        assert hits[7] > hits[6] and hits[9] > hits[8]
        default = r["default"]
        assert default["capacity"] == 64
        assert default["plans"] == r["default_held"] == 64
        assert default["misses"] == 70


def test_plan_cache_size_must_hold_a_plan() -> None:
    from hp_cp_core import DeepSeekV4CPConfig, HpCpError
    from hp_cp_core.plan import PlanCache

    with pytest.raises(HpCpError, match="plan_cache_size must be >= 1, got 0"):
        DeepSeekV4CPConfig(plan_cache_size=0)
    with pytest.raises(HpCpError, match="holds >= 1 plan"):
        PlanCache(0)
    assert PlanCache(3).stats() == {"plans": 0, "capacity": 3, "hits": 0, "misses": 0}
