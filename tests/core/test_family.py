"""The sparse-attention family on the core: DSA (ratio 1, no window, an indexer over tokens),
the two-level indexer, and layers that share compressed KV, index keys or a selection
(Note [The sparse-attention family], Note [Layers that share their indexer])."""

from __future__ import annotations

import numpy as np
import pytest
from _fake_run import fake_host, run_cp

from hp_cp_core import (
    DeepSeekV4CPConfig,
    HpCpError,
    LayerSpec,
    build_rank_plan,
    disable_cp,
    enable_cp,
)
from hp_cp_core.columns import PlanColumns, select_two_level_numpy
from hp_cp_core.layout import SequenceLayout
from hp_cp_core.sharing import SharedState, plan_sharing
from hp_cp_fake import fake_backend as fb

DSA = LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)
LAYOUTS = ("contiguous", "load_balanced")


def _cu(total: int) -> np.ndarray:
    cuts = sorted({3, total // 3, total // 3 + 1, total - 2} - {0, total})
    return np.array([0, *cuts, total])


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("packed", [False, True])
def test_dsa_plan_sees_every_earlier_token_and_moves_only_the_causal_prefix(
    cp: int, layout: str, packed: bool
) -> None:
    total = 2 * cp * 7
    cu = _cu(total) if packed else None
    lay = SequenceLayout(layout, cp, total)
    doc_start = np.zeros(total, dtype=np.int64)
    if packed:
        doc_start = cu[np.searchsorted(cu, np.arange(total), side="right") - 1]
    for rank in range(cp):
        plan = build_rank_plan(
            rank=rank, cp_size=cp, spec=DSA, layout_kind=layout, total_rows=total, cu_seqlens=cu
        )
        rows = lay.rank_rows(rank)
        assert plan.window.n_halo == 0 and plan.x.n_halo == 0
        assert (plan.window_len == 0).all()
        # slot j = token j; query t sees doc_start(t) .. t, itself included
        np.testing.assert_array_equal(plan.cmp_start, doc_start[rows])
        np.testing.assert_array_equal(plan.cmp_count, rows - doc_start[rows] + 1)
        np.testing.assert_array_equal(plan.owned_slots, rows)
        # received: exactly the remote tokens some local query sees (its own lower bound)
        seen = np.zeros(total, dtype=bool)
        for s, c in zip(plan.cmp_start, plan.cmp_count):
            seen[s : s + c] = True
        seen[rows] = False
        np.testing.assert_array_equal(np.sort(plan.slot_exchange.recv_slots), np.flatnonzero(seen))


def _dsa_layer(seed: int = 0, topk: int = 3, reuses: tuple[str, ...] = ()) -> fb.ToyAttention:
    return fb.ToyAttention(
        compress_ratio=1,
        window_size=0,
        index_topk=topk,
        seed=seed,
        has_indexer=True,
        reuses=reuses,
    )


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("packed", [False, True])
def test_dsa_forward_equals_single_device_with_one_collective(
    cp: int, layout: str, packed: bool, monkeypatch
) -> None:
    total = 2 * cp * 5
    cu = _cu(total) if packed else None
    x = np.random.default_rng(cp).normal(size=(total, 6))
    ref = fb.single_device(_dsa_layer(), x, cu)
    monkeypatch.setattr("_fake_run.make_layer", lambda r, w, grid, topk: _dsa_layer(topk=topk))
    results = run_cp(fake_host(), cp=cp, x=x, r=1, window=0, layout=layout, cu=cu, topk=3)
    for rank, res in enumerate(results):
        np.testing.assert_allclose(res.full, ref, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
        # no halo exchange: only the slot exchange (KV rows and index keys in one message)
        exchanges = [e for e in res.log if e["kind"] == "exchange_rows"]
        assert len(exchanges) == 1, res.log


def test_sharing_plan_says_who_owns_what() -> None:
    full = LayerSpec(compress_ratio=4, has_indexer=True)
    reindex = LayerSpec(compress_ratio=4, has_indexer=True, reuses=("compressed_kv", "index_keys"))
    reuse = LayerSpec(
        compress_ratio=4, has_indexer=True, reuses=("compressed_kv", "index_keys", "selection")
    )
    shared = LayerSpec(compress_ratio=1, window_size=0, has_indexer=True, reuses=("selection",))
    swa = LayerSpec(compress_ratio=0)
    plan = plan_sharing([full, reindex, reuse, swa, DSA, shared, shared])
    table = plan.describe()
    assert table[0]["makes"] == ["compressed_kv", "index_keys", "selection"]
    assert table[0]["readers"] == {
        "compressed_kv": [1, 2],
        "index_keys": [1, 2],
    }
    assert table[1]["owners"] == {"compressed_kv": 0, "index_keys": 0, "selection": 1}
    assert table[1]["readers"] == {"selection": [2]} and table[1]["exchanges"] == ["halo"]
    assert table[2]["owners"] == {"compressed_kv": 0, "index_keys": 0, "selection": 1}
    assert table[2]["makes"] == [] and table[2]["exchanges"] == ["halo"]
    assert table[4]["exchanges"] == ["slots"] and table[4]["readers"] == {"selection": [5, 6]}
    # a GLM-5 shared layer: its own KV (one exchange), the owner's selection, no index keys
    assert table[5] == {
        "layer": 5,
        "makes": ["compressed_kv"],
        "owners": {"compressed_kv": 5, "selection": 4},
        "readers": {},
        "exchanges": ["slots"],
    }


@pytest.mark.parametrize(
    "specs, message",
    [
        (
            [LayerSpec(compress_ratio=1, window_size=0, has_indexer=True, reuses=("selection",))],
            "layer 0 reuses 'selection' (LayerSpec.reuses=('selection',)) but no earlier layer "
            "makes it; the first layer of a group must compute it (reuses=()), or pass "
            "share_from= the layer that does.",
        ),
        (
            [
                LayerSpec(compress_ratio=4, has_indexer=True),
                LayerSpec(compress_ratio=1, window_size=0, has_indexer=True, reuses=("selection",)),
            ],
            "layer 1 (compress_ratio=1, packed_grid='per_document') reuses 'selection' from "
            "layer 0 (compress_ratio=4, packed_grid='per_document'); slots and selections are "
            "numbered on the slot grid, so both layers need the same ratio and grid.",
        ),
        (
            [
                DSA,
                LayerSpec(compress_ratio=0),
                LayerSpec(
                    compress_ratio=1,
                    window_size=0,
                    has_indexer=True,
                    reuses=("selection",),
                    share_from=1,
                ),
            ],
            "layer 2 reuses 'selection' from layer 1 (share_from), which does not make it; "
            "layers that make 'selection': [0].",
        ),
    ],
)
def test_sharing_plan_errors(specs: list[LayerSpec], message: str) -> None:
    with pytest.raises(HpCpError) as err:
        plan_sharing(specs)
    assert str(err.value) == message


def test_shared_state_refuses_another_sequence() -> None:
    store = SharedState()
    store.publish(0, (8, None), {"selection": [1]})
    assert store.take(1, 0, (8, None), "selection") == [1]
    with pytest.raises(HpCpError, match="has not published it for this sequence"):
        store.take(1, 0, (16, None), "selection")


class _Stack:
    def __init__(self, layers: list[fb.ToyAttention]) -> None:
        self.layers = layers


def _run_stack(make, cp: int, x: np.ndarray, layout: str, cu) -> list[list]:
    """Every rank runs each layer of its stack in order on ``x``; per rank, per layer:
    (full output, the collectives the layer ran)."""
    world = fb.FakeWorld(cp)
    host = fake_host()

    def rank_fn(rank: int):
        stack = _Stack(make())
        config = DeepSeekV4CPConfig(layout=layout)
        handle = enable_cp(stack, fb.FakeMesh(world, rank), config, plugins=host)
        outs = []
        try:
            local_x = handle.shard(x, 0)
            for layer in stack.layers:
                with world.lock:
                    before = len([e for e in world.log if e["rank"] == rank])
                local = layer(local_x, cu_seqlens=cu)
                with world.lock:
                    mine = [e for e in world.log if e["rank"] == rank][before:]
                outs.append((local, [e["kind"] for e in mine if e["kind"] != "all_gather_meta"]))
            outs = [(handle.unshard(o, 0), kinds) for o, kinds in outs]
            assert handle.sharing is not None
        finally:
            disable_cp(handle)
            assert handle.shared.entries == {}
        return outs

    return world.run(rank_fn)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("packed", [False, True])
def test_shared_layers_equal_single_device_and_run_no_slot_collective(
    cp: int, layout: str, packed: bool
) -> None:
    total = 2 * cp * 6
    cu = _cu(total) if packed else None
    x = np.random.default_rng(7 + cp).normal(size=(total, 6))

    def glm():  # a full DSA layer and a layer reusing its selection (its own KV)
        return [_dsa_layer(seed=1, topk=2), _dsa_layer(seed=2, topk=2, reuses=("selection",))]

    def v41():  # CSA2 Full, Reindex (the Full layer's slots), Reuse (everything)
        def csa(seed, reuses=()):
            return fb.ToyAttention(
                compress_ratio=4, window_size=5, index_topk=2, seed=seed, reuses=reuses
            )

        return [
            csa(3),
            csa(4, ("compressed_kv", "index_keys")),
            csa(5, ("compressed_kv", "index_keys", "selection")),
        ]

    for make, want_kinds in (
        (glm, [["exchange_rows"], ["exchange_rows"]]),
        (v41, [["exchange_rows", "exchange_rows"], ["exchange_rows"], ["exchange_rows"]]),
    ):
        ref_layers = make()
        refs = [fb.single_device(ref_layers[0], x, cu)]
        for lay in ref_layers[1:]:
            owner = ref_layers[0] if "selection" not in lay.reuses else ref_layers[-2]
            if lay.reuses == ("compressed_kv", "index_keys"):  # own selection, owner's slots
                refs.append(fb.single_device(_with_queries(ref_layers[0], lay), x, cu))
                continue
            if "compressed_kv" in lay.reuses:  # Reuse: the Full layer's slots, Reindex's picks
                _, picks = fb._single_device(_with_queries(ref_layers[0], ref_layers[1]), x, cu)
                out, _ = fb._single_device(lay, x, cu, picks_from=picks, kv_layer=ref_layers[0])
                refs.append(out)
                continue
            refs.append(fb.single_device(lay, x, cu, source=owner))
        for rank, res in enumerate(_run_stack(make, cp, x, layout, cu)):
            for i, ((full, kinds), ref) in enumerate(zip(res, refs)):
                where = f"{make.__name__} rank {rank} layer {i}"
                np.testing.assert_allclose(full, ref, rtol=1e-12, atol=1e-12, err_msg=where)
            assert [k for _, k in res] == want_kinds, (make.__name__, rank)


def _with_queries(slots_from: fb.ToyAttention, queries_from: fb.ToyAttention) -> fb.ToyAttention:
    """A toy whose slots are ``slots_from``'s and whose (indexer) queries ``queries_from``'s."""
    lay = fb.ToyAttention(compress_ratio=4, window_size=5, index_topk=2, seed=3)
    lay.wc, lay.wci, lay.wp = slots_from.wc, slots_from.wci, slots_from.wp
    lay.wq, lay.wk, lay.wqi = queries_from.wq, queries_from.wk, queries_from.wqi
    return lay


def test_two_level_selection_keeps_the_best_blocks_then_the_top_k() -> None:
    spec = LayerSpec(compress_ratio=1, window_size=0, has_indexer=True, index_block=4)
    plan = build_rank_plan(rank=0, cp_size=1, spec=spec, layout_kind="contiguous", total_rows=10)
    start, n_blocks = PlanColumns(plan, 0).block_visibility(0, 10, 4)
    np.testing.assert_array_equal(n_blocks, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3])
    rng = np.random.default_rng(0)
    slot_scores = rng.normal(size=(10, 10))
    block_scores = np.tile([0.1, 0.7, 0.3], (10, 1))
    picks = select_two_level_numpy(
        block_scores, slot_scores, start, plan.cmp_count, block=4, keep_blocks=2, topk=3
    )
    # query 9 sees slots 0..9 in blocks [0..3] [4..7] [8, 9]: blocks 1 and 2 kept
    cand = np.arange(4, 10)
    want = cand[np.argsort(-slot_scores[9, 4:10], kind="stable")[:3]]
    np.testing.assert_array_equal(picks[9], want)
    # query 0 sees one slot in one block: one pick, then -1
    np.testing.assert_array_equal(picks[0], [0, -1, -1])
    # ties go to the lower slot
    tied = select_two_level_numpy(
        np.zeros((1, 1)), np.zeros((1, 3)), np.array([0]), np.array([3]), 4, 1, 2
    )
    np.testing.assert_array_equal(tied, [[0, 1]])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["padded", "padded_tail", "packed", "packed_tail"])
def test_dsa_topk_rows_are_the_one_process_rows(cp: int, layout: str, case: str) -> None:
    """Ratio 1 (DSA): the one-process top-k row of a query (Note [The one-process top-k row])
    is the real tokens of the sequence (padded), the document's tokens ("document") or every
    real token of the packed stream ("stream"), the padding ``handle.shard`` appended left
    out; the query's visible tokens always inside it."""
    real = 37
    parts = cp * (2 if layout == "load_balanced" else 1)
    total = -(-real // parts) * parts
    if not case.endswith("tail"):  # no padding: a length every layout divides
        total = real = -(-40 // parts) * parts
    cu = None
    if case.startswith("packed"):
        cuts = [0, 11, 12, 30, real]
        cu = np.array(sorted(set(cuts + [total])), dtype=np.int64)  # the padding: a document
    sequence_rows = real if real < total else None
    docs = np.array([0, total] if cu is None else cu)
    for rank in range(cp):
        plan = build_rank_plan(
            rank=rank, cp_size=cp, spec=DSA, layout_kind=layout, total_rows=total, cu_seqlens=cu
        )
        columns = PlanColumns(plan, 0)
        for kind in ("document", "stream"):
            rows = columns.topk_rows(0, plan.n_local, sequence_rows, packed_row=kind, cu_seqlens=cu)
            seen = 0
            for row in rows:
                for q in range(row.lo, row.hi):
                    seen += 1
                    g = int(plan.local_rows[q])
                    if g >= real:
                        continue  # the layout's padding: no one-process row
                    d = int(np.searchsorted(docs, g, side="right") - 1)
                    if cu is None:
                        want = (0, real)
                    elif kind == "document":
                        want = (int(docs[d]), int(docs[d + 1] - docs[d]))
                    else:
                        want = (0, real)
                    assert (row.start, row.length) == want, (rank, q, g, kind)
                    a, n = int(plan.cmp_start[q]), int(plan.cmp_count[q])
                    assert a == docs[d] and n == g - docs[d] + 1
                    assert row.start <= a and a + n <= row.start + row.length
            assert seen == plan.n_local


@pytest.mark.parametrize("cp", [2, 3])
def test_a_reader_before_its_owner_fails_on_every_rank_before_any_exchange(cp: int) -> None:
    world = fb.FakeWorld(cp)
    host = fake_host()
    x = np.random.default_rng(1).normal(size=(2 * cp * 4, 6))

    def rank_fn(rank: int):
        stack = _Stack([_dsa_layer(seed=1, topk=2), _dsa_layer(seed=2, reuses=("selection",))])
        handle = enable_cp(stack, fb.FakeMesh(world, rank), DeepSeekV4CPConfig(), plugins=host)
        try:
            local_x = handle.shard(x, 0)
            with pytest.raises(HpCpError) as err:
                stack.layers[1](local_x)  # the shared layer alone: its owner has not run
            mine = [e["kind"] for e in world.log if e["rank"] == rank]
            stack.layers[0](local_x)  # in order, it runs
            stack.layers[1](local_x)
        finally:
            disable_cp(handle)
        return str(err.value), mine

    for message, kinds in world.run(rank_fn):
        assert message.startswith(
            "layer 1 reuses 'selection' of layer 0 (LayerSpec.reuses=('selection',)), but layer 0 "
            "has not run on this sequence before it."
        ), message
        assert "exchange_rows" not in kinds
