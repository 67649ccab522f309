"""The vectorised planner against the brute-force per-token definitions of ``_brute``.

For random cp (1..8), layout, r in {0, 4, 128}, W, and padded or packed sequences (random
document lengths: empty, shorter than r, longer than a whole shard; both packed grids), every
rank's :class:`~hp_cp_core.plan.RankPlan` must say exactly what the definitions say: window
keys, slots and their owners, visible slots, RoPE positions, compressed cu_seqlens, the halo
rows (and nothing else) each rank receives, the select-and-pad gather order, the compressed
slots each rank receives point to point (exactly the remote slots its queries see) and its
global-order slot buffer, and compressor segments that produce exactly the owned slots.
"""

from __future__ import annotations

import numpy as np
import pytest
from _brute import World
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hp_cp_core import DeepSeekV4CPConfig, LayerSpec, build_rank_plan, stage1_compress_with_halo
from hp_cp_core.config import DeepSeekV4CPContext
from hp_cp_core.indices import build_cmp_cu_seqlens
from hp_cp_fake.fake_backend import BACKEND, ToyAttention

LAYOUTS = ("contiguous", "load_balanced")
GRIDS = ("per_document", "global")


@st.composite
def plan_cases(draw: st.DrawFn) -> dict:
    cp = draw(st.integers(1, 8), label="cp")
    layout = draw(st.sampled_from(LAYOUTS), label="layout")
    r = draw(st.sampled_from([0, 4, 128]), label="r")
    n_chunks = cp * (2 if layout == "load_balanced" else 1)
    chunk = draw(st.integers(1, 200 if r == 128 else 24), label="chunk rows")
    total = chunk * n_chunks
    window = draw(st.one_of(st.integers(1, 20), st.sampled_from([127, 128, 129, 160])), label="W")
    cu = None
    if draw(st.booleans(), label="packed"):
        local = total // cp
        short = max(r, 2) - 1
        lengths = draw(
            st.lists(
                st.one_of(
                    st.integers(0, short),  # empty, or shorter than r
                    st.integers(1, local + 1),
                    st.integers(local + 1, 3 * local + 2),  # longer than a whole shard
                ),
                min_size=1,
                max_size=10,
            ),
            label="doc lengths",
        )
        cuts = [int(c) for c in np.cumsum(lengths) if c < total]
        cu = [0, *cuts, total]
    grid = draw(st.sampled_from(GRIDS), label="grid")
    return {"total": total, "cp": cp, "layout": layout, "r": r, "W": window, "cu": cu, "grid": grid}


def _plans(case: dict) -> tuple[World, list]:
    spec = LayerSpec(
        compress_ratio=case["r"],
        window_size=case["W"],
        has_indexer=case["r"] == 4,
        packed_grid=case["grid"],
    )
    cu = None if case["cu"] is None else np.array(case["cu"], dtype=np.int64)
    plans = [
        build_rank_plan(
            rank=k,
            cp_size=case["cp"],
            spec=spec,
            layout_kind=case["layout"],
            total_rows=case["total"],
            cu_seqlens=cu,
        )
        for k in range(case["cp"])
    ]
    world = World(
        total_rows=case["total"],
        cp=case["cp"],
        layout=case["layout"],
        r=case["r"],
        window=case["W"],
        cu_seqlens=case["cu"],
        grid=case["grid"],
    )
    return world, plans


def _simulate_exchange(world: World, plans: list, kind: str, rank: int) -> list[list[int]]:
    """Global rows ``rank`` receives from each source (what ``exchange_rows`` would deliver)."""
    per_source = []
    for src in range(world.cp):
        halo = getattr(plans[src], kind)
        rows = [world.rank_rows[src][i] for i in halo.send_rows[rank].tolist()]
        per_source.append(rows)
    return per_source


def _check_halo(world: World, plans: list, kind: str, rank: int, expected: list[int]) -> None:
    plan = plans[rank]
    halo = getattr(plan, kind)
    local = world.rank_rows[rank]
    per_source = _simulate_exchange(world, plans, kind, rank)
    # what arrives is exactly what the rank reads from others: nothing missing, nothing unread
    received = [t for rows in per_source for t in rows]
    assert sorted(received) == expected, f"{kind} halo of rank {rank}"
    assert len(set(received)) == len(received), "a halo row arrives twice"
    assert halo.halo_rows.tolist() == expected
    assert list(halo.recv_counts) == [len(rows) for rows in per_source]
    assert halo.send_rows[rank].size == 0
    for src, rows in enumerate(per_source):
        assert rows == sorted(rows), "rows from one source arrive ascending"
        assert all(world.owner_of_row[t] == src for t in rows)
    # [received ; local] -> ext frame (ascending union of halo and local rows)
    ext = received + local
    if halo.ext_from_recv is not None:
        ext = [ext[i] for i in halo.ext_from_recv.tolist()]
    assert ext == sorted(set(expected) | set(local))
    assert halo.ext_rows.tolist() == ext
    # the received rows, put in halo order, and [halo ; local] -> ext frame
    recv_sorted = received
    if halo.halo_gather is not None:
        recv_sorted = [received[i] for i in halo.halo_gather.tolist()]
    assert recv_sorted == expected
    from_halo = expected + local
    if halo.ext_from_halo is not None:
        from_halo = [from_halo[i] for i in halo.ext_from_halo.tolist()]
    assert from_halo == ext


def _check_slot_exchange(world: World, plans: list, rank: int) -> None:
    """Point-to-point slots: the rank receives exactly the remote slots its queries see, once
    each, and ``[received ; owned ; zero]`` through ``buffer_index`` is global slot order."""
    ex = plans[rank].slot_exchange
    per_source = []
    for src in range(world.cp):
        owned_src = world.owned(src)
        sent = plans[src].slot_exchange.send_rows[rank].tolist()
        per_source.append([owned_src[i] for i in sent])
    received = [s for ids in per_source for s in ids]
    assert sorted(received) == world.slot_halo(rank), f"slots received by rank {rank}"
    assert len(set(received)) == len(received), "a slot arrives twice"
    assert ex.recv_slots.tolist() == received
    assert ex.n_halo == len(received)
    assert list(ex.recv_counts) == [len(ids) for ids in per_source]
    assert ex.send_rows[rank].size == 0
    for src, ids in enumerate(per_source):
        assert ids == sorted(ids) and all(world.owner(s) == src for s in ids)
    n = world.needed_slots(rank)
    assert ex.n_buffer == n
    pool = received + world.owned(rank) + [-1]  # -1: the zero row
    buffer = pool[:n] if ex.buffer_index is None else [pool[i] for i in ex.buffer_index.tolist()]
    seen, owned = set(world.seen_slots(rank)), set(world.owned(rank))
    assert buffer == [s if s in seen or s in owned else -1 for s in range(n)]
    assert ex.n_filler == buffer.count(-1)


def _check_rank(world: World, plans: list, rank: int, x: np.ndarray, toy) -> None:
    plan = plans[rank]
    local = world.rank_rows[rank]
    assert plan.local_rows.tolist() == local
    assert plan.n_local == len(local)
    assert plan.positions.tolist() == [world.position(t) for t in local]

    # window: keys of each local query, through the ext frame
    _check_halo(world, plans, "window", rank, world.window_halo(rank))
    ext_rows = plan.window.ext_rows.tolist()
    for i, t in enumerate(local):
        a, n = int(plan.window_start[i]), int(plan.window_len[i])
        assert n <= world.W
        assert ext_rows[a : a + n] == world.window_keys(t), f"window of query {t}"

    # one run per chunk of local rows, and each run's [halo ; run] slice of the ext frame
    runs, off = [], 0
    for first, n in world.rank_chunks[rank]:
        runs.append([off, off + n, first])
        off += n
    assert [list(run) for run in plan.runs] == runs
    for run in plan.attention_runs():
        a = run.pos_offset
        b = a + run.local_stop - run.local_start
        h = world.window_keys(a)[0]
        assert [run.local_start, run.local_stop, a] in runs
        assert ext_rows[run.ext_start : run.ext_stop] == list(range(h, b))
        assert run.halo_len == a - h

    # the runs cut at document boundaries: what a CP-unaware attention function is handed
    pieces = plan.document_runs
    assert [i for p in pieces for i in range(p.local_start, p.local_stop)] == list(
        range(len(local))
    )
    needed_here = world.needed_slots(rank)
    for k, p in enumerate(pieces):
        rows = local[p.local_start : p.local_stop]
        assert rows == list(range(rows[0], rows[0] + len(rows))), "a piece is one run"
        assert {world.doc_of[t] for t in rows} == {p.doc}
        if k:  # maximal: a piece starts a run or a document
            prev = local[p.local_start - 1]
            starts_run = p.local_start in [lo for lo, _, _ in runs]
            assert world.doc_of[prev] != p.doc or starts_run
        h = world.window_keys(rows[0])[0]
        assert world.doc_of[h] == p.doc
        assert ext_rows[p.ext_start : p.ext_stop] == list(range(h, rows[-1] + 1))
        assert p.halo_len == rows[0] - h
        assert p.pos_offset == world.position(rows[0])
        doc_slots = [s for s in world.slots_of_doc.get(p.doc, []) if s < needed_here]
        if doc_slots:  # the document's slots in the buffer, first slot first
            assert (p.cmp_start, p.cmp_stop) == (doc_slots[0], doc_slots[-1] + 1)
        else:
            assert p.cmp_start == p.cmp_stop <= needed_here
        for t in rows:  # each query sees a prefix of them
            vis = world.visible_slots(t)
            assert vis == list(range(p.cmp_start, p.cmp_start + len(vis)))

    # compressed slots: table size, ownership, RoPE, visibility
    assert plan.n_slots_total == len(world.slots)
    owned = world.owned(rank)
    assert plan.owned_slots.tolist() == owned
    assert plan.owned_rope_pos.tolist() == [world.slots[s].rope_pos for s in owned]
    assert plan.owned_counts.tolist() == [len(world.owned(k)) for k in range(world.cp)]
    needed = 0
    for i, t in enumerate(local):
        vis = world.visible_slots(t)
        start, count = int(plan.cmp_start[i]), int(plan.cmp_count[i])
        assert list(range(start, start + count)) == vis, f"visible slots of query {t}"
        if vis:
            needed = max(needed, vis[-1] + 1)
    assert needed == world.needed_slots(rank)
    assert plan.n_needed_slots == needed <= plan.n_slots_total

    # select-and-pad: simulate the rank-major padded all-gather of every rank's owned ids
    cap = plan.gather_cap
    assert cap == max([len(world.owned(k)) for k in range(world.cp)], default=0)
    buffer = []
    for k in range(world.cp):
        ids = world.owned(k)
        buffer += ids + [-1] * (cap - len(ids))
    gathered = np.array(buffer, dtype=np.int64)
    assert gathered[plan.gather_index].tolist() == list(range(len(world.slots)))
    picked = gathered[plan.gather_index[: plan.n_needed_slots]]
    assert picked.tolist() == list(range(plan.n_needed_slots))

    if world.r == 0:
        assert plan.x is None and plan.segments == () and plan.cmp_cu_seqlens is None
        assert plan.slot_exchange is None
        return
    _check_slot_exchange(world, plans, rank)

    # compressed cu_seqlens (per-document grid)
    if world.packed and world.grid == "per_document":
        assert plan.cmp_cu_seqlens.tolist() == world.cmp_cu_seqlens()
    elif not world.packed:
        assert plan.cmp_cu_seqlens is None

    # x halo = dependency rows of owned slots not held locally
    _check_halo(world, plans, "x", rank, world.x_halo(rank))

    # the segments, fed with the x ext frame, yield exactly the owned slots
    x_ext = x[plan.x.ext_rows]
    outs = []
    for seg in plan.segments:
        assert seg.ext_stop > seg.ext_start
        out = toy.compress(x_ext[seg.ext_start : seg.ext_stop], seg.rope_pos_offset, toy.wc)
        if seg.drop_first:
            out = out[1:]
        assert out.shape[0] == seg.n_slots
        outs.append(out)
    got = np.concatenate(outs) if outs else np.zeros((0, toy.d))
    if world.grid == "global":
        whole = toy.compress(x, 0, toy.wc)
    else:
        parts = [toy.compress(x[a:b], 0, toy.wc) for a, b in world.docs]
        whole = np.concatenate(parts) if parts else np.zeros((0, toy.d))
    assert whole.shape[0] == len(world.slots)
    np.testing.assert_allclose(got, whole[owned], rtol=0, atol=1e-12)

    # and the core helper does the same from (local x, received halo)
    call = DeepSeekV4CPContext(
        cp_rank=rank,
        cp_size=world.cp,
        spec=plan.spec,
        plan=plan,
        config=DeepSeekV4CPConfig(layout=world.layout),
        ops=BACKEND,
    )
    halo_x = x[plan.x.halo_rows] if plan.x.n_halo else None
    helper = stage1_compress_with_halo(
        lambda rows, off: toy.compress(rows, off, toy.wc), x[plan.local_rows], halo_x, call
    )
    np.testing.assert_allclose(helper, whole[owned], rtol=0, atol=1e-12)


def check_case(case: dict) -> None:
    world, plans = _plans(case)
    rng = np.random.default_rng(0)
    toy = ToyAttention(compress_ratio=case["r"] or 4, window_size=case["W"])
    x = rng.normal(size=(case["total"], toy.hidden))
    for rank in range(case["cp"]):
        _check_rank(world, plans, rank, x, toy)
    # ownership partitions the slots: every slot is computed exactly once
    all_owned = sorted(s for p in plans for s in p.owned_slots.tolist())
    assert all_owned == list(range(len(world.slots)))


def _case(total, cp, layout, r, window, cu=None, grid="per_document") -> dict:
    return {"total": total, "cp": cp, "layout": layout, "r": r, "W": window, "cu": cu, "grid": grid}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_cases())
# L < W - 1: the window halo spans several ranks; L not a multiple of r: straddling slots
@example(_case(8 * 2 * 6, 8, "load_balanced", 128, 128))
@example(_case(8 * 2 * 6, 8, "contiguous", 4, 40))
# a packed stream with an empty document, documents shorter than r and one longer than a shard
@example(_case(3 * 100, 3, "contiguous", 128, 128, [0, 5, 5, 60, 250, 251, 300], "global"))
@example(_case(3 * 100, 3, "contiguous", 128, 128, [0, 5, 5, 60, 250, 251, 300]))
@example(_case(4 * 2 * 7, 4, "load_balanced", 4, 9, [0, 2, 3, 3, 40, 41, 56], "global"))
@example(_case(4 * 2 * 7, 4, "load_balanced", 4, 9, [0, 2, 3, 3, 40, 41, 56]))
def test_plan_matches_per_token_definitions(case: dict) -> None:
    check_case(case)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("r", [0, 4, 128])
def test_plan_long_documents_and_short_documents(r: int, layout: str, grid: str) -> None:
    """A fixed packed case on 5 ranks: docs shorter than r, empty, and longer than a shard."""
    total = 5 * 2 * 40  # L = 80 (< r = 128: every HCA slot straddles ranks)
    cu = [0, 3, 3, 130, 131, 133, 400, total]
    assert min(b - a for a, b in zip(cu, cu[1:]) if b > a) < (r or 4)
    assert max(b - a for a, b in zip(cu, cu[1:])) > total // 5
    check_case(_case(total, 5, layout, r, 128, cu, grid))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    r=st.sampled_from([4, 128]),
)
def test_cmp_cu_seqlens_is_cumsum_of_block_counts(lengths: list[int], r: int) -> None:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    expected = [0]
    for n in lengths:
        expected.append(expected[-1] + n // r)
    assert build_cmp_cu_seqlens(np.array(cu), r).tolist() == expected
