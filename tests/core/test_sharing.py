"""DeepSeek V4.1's shared layers in the core: the schedule (hp_cp_core.sharing), ratio 1 and
shared-slot plans (no x halo, no slot exchange, the Full layer's visibility), the n-gram
lookback index and the recorded packed boundaries, against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_cp_core import HpCpError, LayerSpec, build_rank_plan
from hp_cp_core.errors import PlanError
from hp_cp_core.indices import lookback_index
from hp_cp_core.padding import ShardedSequence
from hp_cp_core.sharing import plan_sharing

V41 = dict(  # the released V4.1 Flash schedule (40 layers)
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
    kv_sources=[2, 8, 14, 20],
    index_sources=[2, 8, 14, 20, 24, 28, 32, 36],
    candidate_source=20,
)


def test_released_schedule_roles() -> None:
    plan = plan_sharing(**V41)
    roles = [s.role for s in plan]
    assert roles[:3] == ["window", "window", "full"]
    assert [s.layer for s in plan if s.exchanges_slots] == [2, 8, 14, 20]
    assert plan[3].role == "reuse" and plan[3].slots_from == 2 and plan[3].picks_from == 2
    assert plan[24].role == "reindex" and plan[24].keys_from == 20
    assert plan[24].candidates_from == 20 and plan[25].picks_from == 24
    assert plan[20].makes_candidates and plan[19].candidates_from is None
    assert plan[9].slots_from == 8 and plan[21].slots_from == 20


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(compress_ratios=[0, 2], kv_sources=[], index_sources=[]), "earlier Full layer"),
        (dict(compress_ratios=[2, 1], kv_sources=[0], index_sources=[0]), "(ratio 2)"),
        (dict(compress_ratios=[0, 2], kv_sources=[0], index_sources=[0]), "sliding-window"),
        (dict(compress_ratios=[2], kv_sources=[0], index_sources=[]), "do not select"),
        (
            dict(
                compress_ratios=[1, 1], kv_sources=[0, 1], index_sources=[0, 1], candidate_source=0
            ),
            "drops the candidate blocks",
        ),  # fmt: skip
        (
            dict(compress_ratios=[1], kv_sources=[0], index_sources=[0], candidate_source=3),
            "not a KV source",
        ),
    ],
)
def test_schedule_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(HpCpError, match=None) as err:
        plan_sharing(**kwargs)
    assert words in str(err.value)


@settings(max_examples=60, deadline=None)
@given(
    cp=st.integers(1, 5),
    total=st.integers(1, 90),
    r=st.sampled_from([1, 2, 3]),
    layout=st.sampled_from(["contiguous", "load_balanced"]),
    cuts=st.lists(st.integers(1, 89), max_size=3),
)
def test_shared_plan_has_the_full_layers_visibility_and_no_exchange(
    cp: int, total: int, r: int, layout: str, cuts: list[int]
) -> None:
    parts = cp * (2 if layout == "load_balanced" else 1)
    total = -(-total // parts) * parts
    cu = np.array(sorted({0, total, *[c for c in cuts if c < total]}), dtype=np.int64)
    cu = None if cu.size == 2 else cu
    for rank in range(cp):
        kw = dict(rank=rank, cp_size=cp, layout_kind=layout, total_rows=total, cu_seqlens=cu)
        full = build_rank_plan(spec=LayerSpec(r, 5, has_indexer=True, overlapping=False), **kw)
        shared = build_rank_plan(spec=LayerSpec(r, 5, overlapping=False, shares_slots=True), **kw)
        assert shared.x is None and shared.slot_exchange is None and not shared.segments
        assert np.array_equal(shared.cmp_start, full.cmp_start)
        assert np.array_equal(shared.cmp_count, full.cmp_count)
        assert shared.n_needed_slots == full.n_needed_slots
        assert shared.window.recv_counts == full.window.recv_counts
        if r == 1:  # a slot per row: no x halo, slot j at the position of its row
            assert full.x.n_halo == 0
            starts = np.array([0]) if cu is None else cu[:-1]
            lens = np.array([total]) if cu is None else np.diff(cu)
            pos = np.concatenate([np.arange(n) for n in lens])
            rows = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lens)])
            assert np.array_equal(full.owned_rope_pos, pos[full.owned_slots])
            assert set(rows[full.owned_slots].tolist()) <= set(full.local_rows.tolist())


@settings(max_examples=60, deadline=None)
@given(
    cp=st.integers(1, 4),
    total=st.integers(1, 60),
    n=st.integers(1, 5),
    layout=st.sampled_from(["contiguous", "load_balanced"]),
    cut=st.integers(0, 59),
)
def test_lookback_index_brute_force(cp: int, total: int, n: int, layout: str, cut: int) -> None:
    parts = cp * (2 if layout == "load_balanced" else 1)
    total = -(-total // parts) * parts
    cu = np.array([0, cut, total]) if 0 < cut < total else None
    for rank in range(cp):
        plan = build_rank_plan(
            rank=rank, cp_size=cp, spec=LayerSpec(0, n), layout_kind=layout,
            total_rows=total, cu_seqlens=cu,
        )  # fmt: skip
        look = lookback_index(plan.window_start, plan.window_len, n)
        start = 0 if cu is None else np.where(plan.local_rows >= cut, cut, 0)
        for i, t in enumerate(plan.local_rows):
            for s in range(n):
                src = t - s
                doc0 = start if np.isscalar(start) else start[i]
                if src < doc0:
                    assert look[i, s] == -1
                else:
                    assert plan.window.ext_rows[look[i, s]] == src


def test_recorded_documents() -> None:
    seq = ShardedSequence()
    with pytest.raises(PlanError):
        seq.record_documents([0, 5])
    seq.record(7, 8)
    seq.record_documents([0, 3, 7, 8])
    assert seq.documents(8).tolist() == [0, 3, 7, 8] and seq.documents(6) is None
    seq.record(7, 8)  # the same sequence sharded again keeps them
    assert seq.documents(8) is not None
    seq.record(9, 10)
    assert seq.documents(10) is None
    with pytest.raises(PlanError):
        seq.record_documents([0, 8])
