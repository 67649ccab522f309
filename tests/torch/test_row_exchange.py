"""The runner's exchange of a model's side tensor by the plan (``handle.row_exchange(window,
name)``, :class:`hp_cp_torch.model.runner.RowExchange`, what V4.1's Engram hash uses), and the
read-only views a model file reads instead of the core's plan and handle.

* CP against one process (``row_exchange_cases.py``, one 3-rank gloo job): a causal
  convolution over each row's ``W`` rows back in its document, at cp 1 (the CP path) and
  cp 3, S of 7 to 41 rows (no multiple of the ranks or the window; ``handle.shard`` pads),
  padded and packed (boundaries given or recorded), contiguous and load-balanced: output,
  input gradient and weight gradient within 1e-12 (float64); one halo exchange forward and
  one backward per call.
* A failed value check or problem on one rank: every rank raises the same ``HpCpError``,
  naming the exchange, and nothing is exchanged; rows other than those agreed on are
  refused before the exchange.
* :class:`~hp_cp_torch.model.spec.ModelHandle` (``prepare_model``'s ``handle``) and
  :class:`~hp_cp_torch.model.spec.PlanView` (``state.view``) are frozen; a hook writing
  into the view's arrays never changes the plan; a 0.4 read of the core's handle or plan
  warns and still works.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from dist_utils import run_ranks
from row_exchange_cases import CASES, one_process, row_suite

from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_torch.model.spec import ModelAdapter, ModelHandle, PlanView

TOL = 1e-12


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(3, row_suite, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_side_rows_are_one_process_s(ranks: list[dict], case) -> None:
    got = [r[case.name] for r in ranks if case.name in r]
    assert len(got) == case.cp
    want = one_process(case)
    first = next(r for r in got if r["rank"] == 0)
    for key in ("out", "gx", "gw"):
        assert first[key].shape == want[key].shape, key
        assert torch.allclose(first[key], want[key], atol=TOL, rtol=0), key
    for r in got:
        assert r["halo_exchanges"] == 1 and r["backward_exchanges"] == 1, r
        assert r["frame"][0] == r["local"][0] and r["frame"][2] == r["local"][2], r
        assert r["frame"][1] >= r["local"][1], r  # the halo, then its own rows
        padded = r["local"][1] * case.cp
        assert r["real_rows"] == (case.rows if padded > case.rows else None), r
        if case.recorded:  # what handle.documents(rows) reads of the forward's batch
            assert r["documents"][0] == 0 and r["documents"][-1] == padded, r
            assert list(r["documents"][: len(case.cu)]) == list(case.cu), r
        else:
            assert r["documents"] is None, r


def test_a_failed_check_on_one_rank_raises_on_every_rank(ranks: list[dict]) -> None:
    flagged, problem, other_rows = zip(*(r["refused"] for r in ranks))
    assert all("the rows its agree() was given" in m for m in other_rows), other_rows
    for messages, text in ((flagged, "a bad token id"), (problem, "a bad shape")):
        assert len(set(messages)) == 1, messages
        assert "causal conv under CP" in messages[0] and text in messages[0], messages[0]


def test_prepare_model_is_handed_a_frozen_model_handle(ranks: list[dict]) -> None:
    for r in ranks:
        got = r["handle"]
        assert got["type"] and got["frozen"] and got["cp_size"] == 3 == got["group_size"]
        assert len(got["warned"]) == 1 and "ModelHandle" in got["warned"][0], got


def test_the_spec_declares_module_and_the_handle() -> None:
    assert ModelAdapter.__annotations__["module"] in ("nn.Module", torch.nn.Module)
    hints = ModelAdapter.prepare_model.__func__.__annotations__
    assert hints["handle"] in ("ModelHandle", ModelHandle)
    assert {f.name for f in dataclasses.fields(ModelHandle)} == {
        "cp_size",
        "rank",
        "config",
        "on_disable",
        "documents",
        "row_exchange",
        "_handle",
    }


def test_the_plan_view_is_read_only() -> None:
    spec = LayerSpec(compress_ratio=4, window_size=8)
    plan = build_rank_plan(rank=1, cp_size=3, spec=spec, layout_kind="contiguous", total_rows=48)
    view = PlanView.of(plan, real_rows=45)
    positions, starts = plan.positions.copy(), plan.cmp_start.copy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.positions = np.zeros(3)  # type: ignore[misc]
    view.positions[:] = -1  # a hook writing into its copy (or torch.as_tensor sharing it)
    torch.as_tensor(view.slot_start).zero_()
    assert np.array_equal(plan.positions, positions)
    assert np.array_equal(plan.cmp_start, starts)
    assert np.array_equal(PlanView.of(plan).positions, positions)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert view.n_local == plan.n_local  # a RankPlan field a 0.4 adapter read
    assert [w.category for w in seen] == [DeprecationWarning]
    assert "PlanView" in str(seen[0].message)
