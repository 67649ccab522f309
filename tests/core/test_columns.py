"""The column planner (:mod:`hp_cp_core.columns`) against the brute-force definitions of ``_brute``.

For random plans (the planner property cases) every local query's window columns, visible
slots, indexer scoring chunks, dense window bands and host top-k picks must be exactly what
the per-token definitions say.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planner_properties import _plans, plan_cases

from hp_cp_core.columns import PlanColumns, ScoreChunk, band_readers, select_topk_numpy


def _covered_once(ranges: list[tuple[int, int]], n: int) -> np.ndarray:
    seen = np.zeros(n, dtype=np.int64)
    for lo, hi in ranges:
        assert 0 <= lo < hi <= n
        seen[lo:hi] += 1
    return seen


def _inside_one_run(plan, lo: int, hi: int) -> bool:
    return any(a <= lo and hi <= b for a, b, _ in plan.runs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_cases(), chunk=st.integers(1, 40), block=st.integers(1, 40))
def test_columns_match_brute_force(case: dict, chunk: int, block: int) -> None:
    world, plans = _plans(case)
    for rank, plan in enumerate(plans):
        local = world.rank_rows[rank]
        n_ext = plan.window.ext_rows.size
        columns = PlanColumns(plan, n_ext)
        ext = plan.window.ext_rows
        window = columns.window(0, plan.n_local)
        slots = columns.visible_slots(0, plan.n_local)
        assert window.shape == (plan.n_local, case["W"])
        for i, t in enumerate(local):
            keys = window[i][window[i] >= 0]
            # single-device order: ascending keys first, then -1 padding
            assert (window[i][: keys.size] >= 0).all() and (window[i][keys.size :] == -1).all()
            assert ext[keys].tolist() == world.window_keys(t)
            assert slots[i][slots[i] >= 0].tolist() == world.visible_slots(t)
            assert (slots[i][len(world.visible_slots(t)) :] == -1).all()
        pool = columns.pool_rows(slots)
        assert np.array_equal(pool, np.where(slots >= 0, slots + n_ext, -1))

        # the indexer's scoring work: every query that sees a slot, exactly once
        score = columns.score_chunks(chunk)
        seen = _covered_once([(c.lo, c.hi) for c in score], plan.n_local)
        for i, t in enumerate(local):
            assert seen[i] == (1 if world.visible_slots(t) else seen[i]), t
        for c in score:
            assert c.hi - c.lo <= chunk and _inside_one_run(plan, c.lo, c.hi)
            assert c.visible.shape == (c.hi - c.lo, c.slot_stop - c.slot_start)
            for i in range(c.lo, c.hi):
                got = (np.flatnonzero(c.visible[i - c.lo]) + c.slot_start).tolist()
                assert got == world.visible_slots(local[i])

        # dense blocks: every query once; the masks select exactly its window and its slots
        blocks = columns.dense_blocks(block, with_slots=True)
        seen = _covered_once([(b.lo, b.hi) for b in blocks], plan.n_local)
        assert (seen == 1).all()
        assert [(b.lo, b.hi) for b in columns.dense_blocks(block)] == [(b.lo, b.hi) for b in blocks]
        for b in blocks:
            assert b.hi - b.lo <= block and _inside_one_run(plan, b.lo, b.hi)
            assert b.key_stop - b.key_start <= (b.hi - b.lo) + case["W"] - 1
            for i in range(b.lo, b.hi):
                keys = np.flatnonzero(b.mask[i - b.lo]) + b.key_start
                assert ext[keys].tolist() == world.window_keys(local[i])
                got = []
                if b.slot_mask is not None:
                    got = (np.flatnonzero(b.slot_mask[i - b.lo]) + b.slot_start).tolist()
                assert got == world.visible_slots(local[i])

        # CSA: where a block's visible slots fit in picks_band_max, its picks are a band
        for limit in (1, 8, 10**9):
            csa = columns.dense_blocks(block, picks_band_max=limit)
            assert [(b.lo, b.hi) for b in csa] == [(b.lo, b.hi) for b in blocks]
            for b, hca in zip(csa, blocks):
                assert b.slot_mask is None
                if not b.picks_in_band:
                    assert limit < 10**9 or hca.slot_mask is None
                    continue
                assert b.slot_stop - b.slot_start <= limit
                assert (b.slot_start, b.slot_stop) == (hca.slot_start, hca.slot_stop)
                for i in range(b.lo, b.hi):  # every visible slot (any pick) is in the band
                    seen = world.visible_slots(local[i])
                    assert all(b.slot_start <= j < b.slot_stop for j in seen)
        with pytest.raises(ValueError, match="exclude"):
            columns.dense_blocks(block, with_slots=True, picks_band_max=8)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    slots=st.integers(1, 12),
    topk=st.integers(1, 15),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_topk_numpy_is_the_stable_top_k_of_visible_slots(n, slots, topk, seed) -> None:
    rng = np.random.default_rng(seed)
    s0 = int(rng.integers(0, 50))
    # each query sees one range of slots (a causal prefix of its document)
    first = s0 + rng.integers(0, slots, size=n)
    stop = np.minimum(first + rng.integers(0, slots + 1, size=n), s0 + slots)
    chunk = ScoreChunk(0, n, s0, s0 + slots, first, stop)
    visible = chunk.visible
    assert visible.shape == (n, slots)
    assert (visible.sum(axis=1) == stop - first).all()
    # few distinct values, so ties are common; -inf scores may be visible too
    scores = rng.integers(-2, 3, size=(2, n, slots)).astype(np.float64)
    scores[scores == -2] = -np.inf
    got = select_topk_numpy(scores, chunk, topk)
    assert got.shape == (2, n, topk)
    for b in range(2):
        for i in range(n):
            cand = [j for j in range(slots) if visible[i, j] and scores[b, i, j] != -np.inf]
            cand.sort(key=lambda j: (-scores[b, i, j], j))  # ties to the lower slot
            want = [s0 + j for j in cand[:topk]]
            assert got[b, i].tolist() == want + [-1] * (topk - len(want))


def _readers_by_sort(idx: np.ndarray, n_rows: int) -> list[list[tuple[int, int]]]:
    """Per pool row, its ``(query, column)`` readers in the column lists ``idx`` (a sort)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(n_rows)]
    for t, c in zip(*np.nonzero(idx >= 0)):
        out[idx[t, c]].append((int(t), int(c)))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_cases(), chunk=st.integers(1, 40))
def test_column_bands_readers_match_the_inverted_columns(case: dict, chunk: int) -> None:
    """Note [Readers of a band]: the plan-derived reader ranges of the window and HCA bands,
    masked as a kernel masks them, are exactly the inverse of the column lists, in query
    order."""
    _, plans = _plans(case)
    for plan in plans:
        n_ext = plan.window.ext_rows.size
        columns = PlanColumns(plan, n_ext)
        n_pool = n_ext + plan.n_needed_slots
        for lo, hi in columns.chunks(chunk):
            bands = columns.column_bands(lo, hi, n_pool, with_slots=True)
            assert bands is not None  # the planner's bands are monotone in every run
            hca = columns.pool_rows(columns.visible_slots(lo, hi))
            idx = np.concatenate([columns.window(lo, hi), hca], axis=1)
            assert bands.n_columns == idx.shape[1]
            got: list[list[tuple[int, int]]] = [[] for _ in range(n_pool)]
            for r in range(n_pool):
                for j in range(bands.col0.size):
                    for run in range(bands.first.shape[1]):
                        for t in range(bands.first[j, run, r], bands.stop[j, run, r]):
                            s, n = bands.start[j, t], bands.length[j, t]
                            if s <= r < s + n:
                                got[r].append((t, int(bands.col0[j] + r - s)))
            assert got == _readers_by_sort(idx, n_pool)


def test_band_readers_refuse_bands_that_are_not_ranges() -> None:
    start, length = np.array([0, 2, 1]), np.array([1, 1, 1])  # starts go back: not a range
    assert band_readers(start, length, [(0, 3)], 4) is None
    first, stop = band_readers(start, length, [(0, 2), (2, 3)], 4)  # two runs: ranges
    assert first.tolist() == [[0, 0, 1, 0], [0, 2, 0, 0]]
    assert stop.tolist() == [[1, 0, 2, 0], [0, 3, 0, 0]]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_cases(), chunk=st.integers(1, 40), pad=st.integers(0, 7))
def test_topk_rows_are_the_one_process_rows(case: dict, chunk: int, pad: int) -> None:
    """Every local query once, in its document's one-process top-k row (Note [The one-process
    top-k row]): padded, the real rows' slots; packed, the document's own slots or every real
    document's; the query's visible slots always inside its row."""
    if case["r"] != 4 or case["grid"] != "per_document":
        return
    world, plans = _plans(case)
    total, r = case["total"], case["r"]
    cu = np.array(case["cu"] if case["cu"] is not None else [0, total], dtype=np.int64)
    real = max(total - pad, 0) if case["cu"] is None else total
    if case["cu"] is not None and pad and cu.size > 2:  # the last document is the padding
        real = int(cu[-2])
    doc_slots = np.diff(cu) // r
    slot_cu = np.concatenate([[0], np.cumsum(doc_slots)])
    for rank, plan in enumerate(plans):
        columns = PlanColumns(plan, plan.window.ext_rows.size)
        for kind in ("document", "stream"):
            seen = []
            for lo, hi in columns.run_chunks(chunk):
                rows = columns.topk_rows(lo, hi, real, packed_row=kind, cu_seqlens=cu)
                assert [(t.lo, t.hi) for t in rows][0][0] == lo and rows[-1].hi == hi
                for t in rows:
                    seen.append((t.lo, t.hi))
                    for q in range(t.lo, t.hi):
                        g = int(world.rank_rows[rank][q])
                        d = int(np.searchsorted(cu, g, side="right") - 1)
                        if case["cu"] is None:
                            want = (0, real // r)
                        elif kind == "document":
                            want = (int(slot_cu[d]), int(doc_slots[d]))
                        else:
                            n_real = int(np.searchsorted(cu[1:], real, side="right"))
                            want = (0, int(slot_cu[n_real]))
                        assert (t.start, t.length) == want, (rank, q, g, kind)
                        a, n = int(plan.cmp_start[q]), int(plan.cmp_count[q])
                        if g < real and n:
                            assert t.start <= a and a + n <= t.start + t.length
            assert _covered_once(seen, plan.n_local).tolist() == [1] * plan.n_local
