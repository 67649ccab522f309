"""The torch backend's API on real gloo groups: meshes and process groups, a CP group of one,
``disable_cp``, traffic in ``handle.stats()``, inconsistent inputs, ranks with nothing to
receive or nothing to see, and a third-party plugin replacing the attention kernel."""

from __future__ import annotations

import pytest
from cases import (
    Case,
    check_adapter_parity,
    check_comm_counts,
    check_parity,
    empty_rank_cases,
    parity_case,
    result,
)

pytestmark = pytest.mark.slow

# ------------------------------------------------------------------ ranks with nothing to do

EMPTY = [pytest.param(w, c, id=c.name) for w in (2, 4) for c in empty_rank_cases(w)]


@pytest.mark.parametrize(("world", "case"), EMPTY)
def test_rank_without_halo_or_slots_completes_backward(world: int, case: Case) -> None:
    """Forward and ``loss.backward()`` finish on every rank (no hang) and match one device."""
    per_rank = result("api", world, f"empty:{case.name}")
    assert case.backward == "backward"
    rank0 = next(r for r in per_rank if r["cp_rank"] == 0)
    check_parity(case, rank0)
    check_comm_counts(case, per_rank)


def test_empty_rank_cases_are_really_empty() -> None:
    """The plans of those cases do have ranks with no halo, no owned slot, no visible slot."""
    import numpy as np
    from cases import case_cu

    from hp_cp_core import LayerSpec
    from hp_cp_core.plan import build_rank_plan

    seen = {"no_window_halo_not_rank0": 0, "owns_no_slot": 0, "sees_no_slot": 0}
    for case in [c for w in (2, 4) for c in empty_rank_cases(w)]:
        spec = LayerSpec(compress_ratio=case.r, window_size=case.window, has_indexer=case.r == 4)
        cu = case_cu(case)
        for rank in range(case.cp):
            plan = build_rank_plan(
                rank=rank,
                cp_size=case.cp,
                spec=spec,
                layout_kind=case.layout,
                total_rows=case.total,
                cu_seqlens=None if cu is None else np.array(cu),
            )
            if rank and plan.window.n_halo == 0 and plan.x.n_halo == 0:
                seen["no_window_halo_not_rank0"] += 1
            seen["owns_no_slot"] += plan.n_owned == 0
            seen["sees_no_slot"] += int(plan.cmp_count.sum()) == 0
    assert all(seen.values()), seen


# ------------------------------------------------------------------ meshes and groups


@pytest.mark.parametrize("kind", ["mesh_1d", "mesh_2d_cp", "process_group"])
def test_enable_cp_accepts_mesh_or_group(kind: str) -> None:
    per_rank = result("api", 4, f"mesh:{kind}")
    case = per_rank[0]["case"]
    assert {r["cp_size"] for r in per_rank} == {case.cp}
    assert case.cp == (2 if kind == "mesh_2d_cp" else 4)
    for r in per_rank:
        if r["cp_rank"] == 0:  # one per CP group (two groups for the 2-D mesh)
            check_parity(case, r)
    check_comm_counts(case, per_rank)


def test_two_dimensional_mesh_is_a_clear_error() -> None:
    for r in result("api", 4, "mesh_2d_error"):
        assert r["error"] is not None, "a 2-D mesh was accepted"
        assert "1-D" in r["error"] and "mesh['cp']" in r["error"], r["error"]
        assert "('dp', 'cp')" in r["error"], r["error"]
        assert r["untouched"]


def test_not_a_mesh_is_a_clear_error() -> None:
    for r in result("api", 2, "not_a_mesh"):
        assert r["error"] is not None and "DeviceMesh" in r["error"], r["error"]


@pytest.mark.parametrize(("world", "kind"), [(1, "world"), (4, "mesh_dim"), (4, "process_group")])
def test_group_of_one_keeps_the_original_path(world: int, kind: str) -> None:
    for r in result("api", world, f"group_of_one:{kind}"):
        assert r["cp_size"] == 1
        assert r["untouched"], "enable_cp replaced the forward of a CP group of size 1"
        assert r["identical"], "output differs from the plain module"
        assert r["stats"]["bytes_sent"] == 0 and r["stats"]["bytes_recv"] == 0


# ------------------------------------------------------------------ enable / disable / stats


def test_disable_cp_restores_the_original_forward() -> None:
    for r in result("api", 2, "disable"):
        assert r["patched"]
        assert r["cp_err"] <= 1e-5
        assert r["restored_class_forward"] and r["bound_to_class"]
        assert r["plain_again"]
        assert r["replaced_instance"] and r["restored_instance"]
        assert "already runs under CP" in r["double_enable"]
        assert r["reenabled_err"] <= 1e-5


BYTES = [
    parity_case(2, 4, packed=True),
    parity_case(2, 128, "load_balanced"),
    parity_case(2, 0, "load_balanced", packed=True),
]


@pytest.mark.parametrize("case", BYTES, ids=[c.name for c in BYTES])
def test_stats_report_the_bytes_of_the_plan(case: Case) -> None:
    per_rank = result("api", 2, f"bytes:{case.name}")
    assert sum(r["stats"]["bytes_sent"] for r in per_rank) > 0
    for r in per_rank:
        stats = r["stats"]
        assert stats["backend"] == "torch" and stats["cp_size"] == 2
        assert stats["bytes_sent"] == r["want_sent"]
        assert stats["bytes_recv"] == r["want_recv"]
        assert stats["collectives"] == {
            "halo_exchange": 1,
            **({"slot_exchange": 1} if case.r else {}),
        }
        assert stats["compressed_slot_exchange"] == "p2p"


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("world", [2, 4])
def test_inconsistent_inputs_raise_on_every_rank(world: int) -> None:
    per_rank = result("api", world, "bad_rows")
    assert len(per_rank) == world
    for r in per_rank:
        errors = r["errors"]
        assert set(errors) == {"rows", "cu_seqlens", "not_global"}, errors
        kind, msg = errors["rows"]
        assert kind == "PlanError" and "inconsistent" in msg and "local rows per rank" in msg
        assert str([8 + k for k in range(world)]) in msg, msg
        kind, msg = errors["cu_seqlens"]
        assert kind == "PlanError" and "cu_seqlens per rank [[0, 5, " in msg, msg
        assert f"[0, 6, {8 * world}]]. Expected the same global cu_seqlens" in msg, msg
        kind, msg = errors["not_global"]
        assert kind == "PlanError" and "global cu_seqlens" in msg, msg
        assert r["after"][1] == 7 * 2, "the group did not work after the errors"


# ------------------------------------------------------------------ attention kernel plugin


def test_stages_go_straight_to_the_runner() -> None:
    """With no plugin overriding a stage, a layer forward runs its four stages on the torch
    runner directly: pluggy runs none of the stage hooks (it chose the backend and the layer
    spec in enable_cp), whatever other backends are installed."""
    case = parity_case(2, 4, "load_balanced", packed=True)
    for r in result("api", 2, "direct"):
        if r["cp_rank"] == 0:
            check_parity(case, r)
        stages = ("extract_ori_kv", "compress_main", "compress_indexer", "run_attention")
        assert not {f"hp_cp_{s}" for s in stages} & set(r["hooks_called"]), r["hooks_called"]
        assert "hp_cp_layer_spec" in r["hooks_called"], r["hooks_called"]  # pluggy, in enable_cp
        assert r["adapter_counts"] == dict.fromkeys(stages, 1), r["adapter_counts"]


@pytest.mark.parametrize("how", ["global", "host"])
def test_plugin_overrides_only_run_attention(how: str) -> None:
    """A ``tryfirst`` plugin implementing only ``hp_cp_run_attention`` takes over that stage
    for the reference layer; every other stage, and other modules, stay with torch."""
    case = (
        parity_case(2, 4, "load_balanced", packed=True) if how == "global" else parity_case(2, 128)
    )
    per_rank = result("api", 2, f"override:{how}")
    rank0 = next(r for r in per_rank if r["cp_rank"] == 0)
    check_parity(case, rank0)  # the override's attention is the exact one
    for r in per_rank:
        impls = r["impls"]
        assert impls["hp_cp_run_attention"][-1] == "override", impls  # called first
        for hook in (
            "hp_cp_backend",
            "hp_cp_layer_spec",
            "hp_cp_extract_ori_kv",
            "hp_cp_compress_main",
            "hp_cp_compress_indexer",
        ):
            assert "override" not in impls[hook], (hook, impls)
        assert r["calls_parity"] == 1
        assert r["doubled_err"] <= 1e-6, "the override's return value was not used"
        counts = r["adapter_counts"]
        assert counts["extract_ori_kv"] == counts["compress_main"] == 1, counts
        assert counts.get("compress_indexer", 0) == (1 if case.r == 4 else 0), counts
        assert counts["run_attention"] == 1  # only through the override's own delegation
        assert r["calls_generic"] == 0, "the override ran for a module it does not know"
    generic_rank0 = next(r["generic"] for r in per_rank if r["generic"]["cp_rank"] == 0)
    from cases import AdapterCase

    check_adapter_parity(AdapterCase(2, 4, chunk=7), generic_rank0)
