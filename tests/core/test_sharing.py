"""DeepSeek V4.1's shared layers in the core: its released schedule as LayerSpecs (one
plan_sharing for the family: Full / Reindex / Reuse layers, the two-level indexer's candidate
blocks from one Full layer), ratio 1 and shared-slot plans (no x halo, no slot exchange, the
Full layer's visibility), the n-gram lookback index and the recorded packed boundaries,
against brute force."""

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

KV = ("compressed_kv", "index_keys")


def v41_specs(
    ratios: list[int], kv: list[int], ix: list[int], cand: int = -1, block: int = 8
) -> list[LayerSpec]:
    """The LayerSpecs NeMo's V4.1 layers get (as hp_cp_torch's adapter builds them)."""
    out = []
    for i, r in enumerate(ratios):
        if r == 0:
            out.append(LayerSpec(0, 128))
            continue
        two_level = cand >= 0 and i >= cand and i in ix
        after = 0 <= cand < i
        if i in kv:
            reuses: tuple[str, ...] = ("candidates",) if after else ()
        elif i in ix:
            reuses = KV + (("candidates",) if after else ())
        else:
            reuses = (*KV, "selection")
        out.append(
            LayerSpec(
                r,
                128,
                has_indexer=True,
                overlapping=False,
                index_block=block if two_level else 0,
                reuses=reuses,
            )
        )
    return out


V41 = dict(  # the released V4.1 Flash schedule (40 layers)
    ratios=[0, 0] + [2] * 18 + [1] * 20,
    kv=[2, 8, 14, 20],
    ix=[2, 8, 14, 20, 24, 28, 32, 36],
    cand=20,
)


def test_released_schedule_owners() -> None:
    plan = plan_sharing(v41_specs(**V41))
    table = plan.describe()
    for window in (0, 1):  # sliding-window layers: nothing shared, their window halo
        want = {"layer": window, "makes": [], "owners": {}, "readers": {}, "exchanges": ["halo"]}
        assert table[window] == want
    assert [r.layer for r in plan.layers if "slots" in r.exchanges] == [2, 8, 14, 20]
    assert all(r.exchanges == ("halo",) for r in plan.layers if r.layer not in (2, 8, 14, 20))
    # layer 3 is a Reuse layer: layer 2's slots and selection
    assert table[3]["owners"] == {"compressed_kv": 2, "index_keys": 2, "selection": 2}
    assert table[3]["makes"] == []
    # layer 24 is a Reindex layer: layer 20's keys and candidate blocks, its own selection
    assert table[24]["owners"] == {
        "compressed_kv": 20,
        "index_keys": 20,
        "selection": 24,
        "candidates": 20,
    }
    assert table[25]["owners"]["selection"] == 24
    assert table[20]["makes"] == ["compressed_kv", "index_keys", "selection", "candidates"]
    assert table[20]["readers"]["candidates"] == [24, 28, 32, 36]
    assert "candidates" not in table[19]["owners"]
    assert table[9]["owners"]["compressed_kv"] == 8 and table[21]["owners"]["compressed_kv"] == 20
    assert table[2]["readers"]["compressed_kv"] == [3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "specs, words",
    [
        (  # a shared layer with no Full layer before it
            v41_specs([0, 2], kv=[], ix=[]),
            "layer 1 reuses 'compressed_kv' (LayerSpec.reuses=('compressed_kv', 'index_keys', "
            "'selection')) but no earlier layer makes it",
        ),
        (  # the last Full layer before it has another ratio
            v41_specs([2, 1], kv=[0], ix=[0]),
            "layer 1 (compress_ratio=1, packed_grid='per_document') reuses 'compressed_kv' from "
            "layer 0 (compress_ratio=2",
        ),
        (  # candidate blocks of another size
            [
                LayerSpec(1, 4, has_indexer=True, index_block=8),
                LayerSpec(1, 4, has_indexer=True, index_block=4, reuses=(*KV, "candidates")),
            ],
            "layer 1 (index_block=4) reuses the candidate blocks of layer 0 (index_block=8)",
        ),
        (  # candidate blocks no earlier layer keeps
            [
                LayerSpec(1, 4, has_indexer=True),
                LayerSpec(1, 4, has_indexer=True, index_block=4, reuses=(*KV, "candidates")),
            ],
            "layer 1 reuses 'candidates'",
        ),
    ],
)
def test_schedule_errors(specs: list[LayerSpec], words: str) -> None:
    with pytest.raises(HpCpError) as err:
        plan_sharing(specs)
    assert words in str(err.value)


def test_candidates_need_a_two_level_reader() -> None:
    with pytest.raises(HpCpError, match="names 'candidates'"):
        LayerSpec(2, 4, has_indexer=True, reuses=(*KV, "candidates"))
    spec = LayerSpec(2, 4, has_indexer=True, index_block=4, reuses=(*KV, "candidates"))
    assert not spec.makes_slots and not spec.makes_candidates and spec.makes_selection
    assert LayerSpec(2, 4, has_indexer=True, index_block=4).makes_candidates


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
        shared_spec = LayerSpec(r, 5, has_indexer=True, overlapping=False, reuses=KV)
        shared = build_rank_plan(spec=shared_spec, **kw)
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
