"""The one batch path (Note [One batch path] in ``hp_cp_core.batch``): ``plan_batch`` against
per-token definitions written here with loops, and ``handle.batch`` on the fake backend (each
rank's rows of the padded, shifted batch), for any S, cp 1-8, both layouts, padded and packed."""

from __future__ import annotations

import numpy as np
import pytest
from _fake_run import make_layer

from hp_cp_core import CPBatch, HpCpError, PlanError, disable_cp, enable_cp, plan_batch
from hp_cp_core.layout import SequenceLayout
from hp_cp_core.plugins import PluginHost
from hp_cp_fake import fake_backend as fb

IGNORE = -100


def brute_padded_rows(rows: int, cp: int, layout: str) -> int:
    parts = cp * (2 if layout == "load_balanced" else 1)
    padded = rows
    while padded % parts:
        padded += 1
    return padded


def brute_documents(rows: int, padded: int, cu: list[int] | None) -> list[tuple[int, int]]:
    """``(first, end)`` of the document of each row of the padded stream."""
    bounds = [0, rows] if cu is None else list(cu)
    if padded > rows and cu is not None:
        bounds.append(padded)
    out = []
    for t in range(padded):
        spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if a <= t < b]
        out.append(spans[0] if spans else (0, padded))  # unpacked: the padding trails doc 0
    return out


def brute_shifted(labels: np.ndarray, padded: int, cu: list[int] | None) -> np.ndarray:
    """Row t predicts label t + 1 when it is a real token of t's own document."""
    batch, rows = labels.shape
    docs = brute_documents(rows, padded, cu)
    out = np.full((batch, padded), IGNORE, dtype=labels.dtype)
    for b in range(batch):
        for t in range(padded):
            nxt = t + 1
            if t < rows and nxt < rows and docs[t][0] <= nxt < docs[t][1]:
                out[b, t] = labels[b, nxt]
    return out


def random_cu(rng: np.random.Generator, rows: int) -> list[int]:
    cuts = sorted(rng.integers(0, rows + 1, size=int(rng.integers(0, 4))).tolist())
    return [0, *cuts, rows]  # empty documents included


CASES = [
    (rows, cp, layout, packed)
    for rows in (1, 5, 7, 16, 23)
    for cp in (1, 2, 3, 4, 5, 8)
    for layout in ("contiguous", "load_balanced")
    for packed in (False, True)
]


@pytest.mark.parametrize(("rows", "cp", "layout", "packed"), CASES)
def test_plan_matches_per_token_definitions(rows: int, cp: int, layout: str, packed: bool) -> None:
    rng = np.random.default_rng(rows * 100 + cp * 10 + packed)
    cu = random_cu(rng, rows) if packed else None
    plan = plan_batch(rows, cp, layout, cu)
    padded = brute_padded_rows(rows, cp, layout)
    assert (plan.rows, plan.padded_rows, plan.packed) == (rows, padded, packed)
    docs = brute_documents(rows, padded, cu)
    assert plan.positions.tolist() == [t - docs[t][0] for t in range(padded)]
    assert plan.documents.tolist() == [_doc_index(cu, rows, padded, t) for t in range(padded)]
    if packed:
        want = list(cu) + ([padded] if padded > rows else [])
        assert plan.cu_seqlens.tolist() == want
    else:
        assert plan.cu_seqlens is None
    labels = rng.integers(0, 50, size=(2, rows))
    labels[0, rng.integers(0, rows)] = IGNORE  # a label the caller already masked
    shifted = plan.shifted_labels(labels, IGNORE)
    np.testing.assert_array_equal(shifted, brute_shifted(labels, padded, cu))


def _doc_index(cu: list[int] | None, rows: int, padded: int, t: int) -> int:
    """The index of row t's document among the padded stream's boundaries (loops)."""
    if cu is None:
        return 0
    bounds = list(cu) + ([padded] if padded > rows else [])
    index = 0
    for d in range(len(bounds) - 1):
        if bounds[d] <= t < bounds[d + 1]:
            index = d
    return index


def test_bad_boundaries_raise_plan_errors() -> None:
    with pytest.raises(PlanError, match="end at the global row count 7"):
        plan_batch(7, 2, "contiguous", [0, 3, 8])
    with pytest.raises(PlanError, match="non-decreasing"):
        plan_batch(7, 2, "contiguous", [0, 5, 3, 7])


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("cp", [1, 2, 3, 8])
@pytest.mark.parametrize("packed", [False, True])
def test_handle_batch_gives_each_rank_its_rows(
    host: PluginHost, cp: int, layout: str, packed: bool
) -> None:
    rows = 13
    rng = np.random.default_rng(cp)
    cu = [0, 4, 4, 9, rows] if packed else None
    batch = 1 if packed else 2
    ids = rng.integers(1, 90, size=(batch, rows))
    labels = rng.integers(0, 90, size=(batch, rows))
    padded = brute_padded_rows(rows, cp, layout)
    full_ids = np.concatenate([ids, np.zeros((batch, padded - rows), ids.dtype)], 1)
    docs = brute_documents(rows, padded, cu)
    full_pos = np.array([[t - docs[t][0] for t in range(padded)]])
    full_labels = brute_shifted(labels, padded, cu)
    world = fb.FakeWorld(cp)
    for rank in range(cp):
        config_layer = make_layer(4, 5)
        handle = enable_cp(config_layer, fb.FakeMesh(world, rank), _config(layout), plugins=host)
        try:
            got = handle.batch(ids, labels=labels, cu_seqlens=cu, ignore_index=IGNORE)
            assert isinstance(got, CPBatch)
            mine = SequenceLayout(layout, cp, padded).shard_index(rank)
            np.testing.assert_array_equal(got.input_ids, full_ids[:, mine])
            np.testing.assert_array_equal(got.position_ids, full_pos[:, mine])
            np.testing.assert_array_equal(got.labels, full_labels[:, mine])
            assert int(got.n_tokens) == int((full_labels != IGNORE).sum())
            if packed:
                want = cu + ([padded] if padded > rows else [])
                assert np.asarray(got.cu_seqlens).tolist() == want
                assert got.model_inputs()["hp_cp_cu_seqlens"] is got.cu_seqlens
            else:
                assert got.cu_seqlens is None and "hp_cp_cu_seqlens" not in got.model_inputs()
            real = handle.sequence.real_rows(layout, cp, rank, padded)
            if padded > rows:  # the padding recorded: the indexer loss leaves it out
                assert real.tolist() == (mine < rows).tolist()
            if cp == 1 and (packed or padded > rows):
                assert not handle.bypassed  # the model's own forward reads neither
        finally:
            disable_cp(handle)


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
def test_model_inputs_records_its_batch_again_for_prefetched_batches(
    host: PluginHost, layout: str
) -> None:
    """Batches built ahead of their forward (prefetched micro-batches): the record of the
    padding is the last batch's until ``model_inputs()`` of the one about to run points it at
    that one again, in any order, also between two batches of the same padded length."""
    cp = 3
    world = fb.FakeWorld(cp)
    for rank in range(cp):
        handle = enable_cp(
            make_layer(4, 5), fb.FakeMesh(world, rank), _config(layout), plugins=host
        )
        try:
            padded = handle.padding(11).padded_rows  # 11 and 12 rows pad alike at cp 3
            mine = SequenceLayout(layout, cp, padded).shard_index(rank)
            a, b = (handle.batch(np.ones((2, rows), np.int64)) for rows in (11, padded))
            c = handle.batch(np.ones((2, 7), np.int64))  # another padded length
            for batch, rows in ((a, 11), (c, 7), (b, padded), (a, 11), (b, padded)):
                batch.model_inputs()
                total = batch.plan.padded_rows
                real = handle.sequence.real_rows(layout, cp, rank, total)
                want = SequenceLayout(layout, cp, total).shard_index(rank) < rows
                if rows == total:
                    assert real is None  # every row is real
                else:
                    assert real.tolist() == want.tolist(), (rows, rank)
            assert len(mine) == padded // cp
        finally:
            disable_cp(handle)


def test_ranks_given_other_batches_raise_the_same_error_in_the_forward(
    host: PluginHost,
) -> None:
    """``handle.batch`` on every rank of a CP group must get the same full batch; ids that
    differ per rank (data loaded by the global rank) or that are already this rank's shard
    are found in the forward's agreement, and every rank raises the same error."""
    cp, rows = 3, 10
    world = fb.FakeWorld(cp)
    x = np.random.default_rng(0).standard_normal((12, 6))  # 10 rows padded to 12

    def rank_fn(rank: int) -> list[str]:
        layer = make_layer(4, 5)
        handle = enable_cp(layer, fb.FakeMesh(world, rank), _config("contiguous"), plugins=host)
        seen = []
        try:
            ids = np.arange(1, rows + 1)[None]
            for given in (ids, ids + rank, ids, handle.shard(np.arange(2 * cp * 4)[None], 1)):
                batch = handle.batch(given)
                rows_given = batch.plan.padded_rows
                try:
                    local = x[:rows_given] if rows_given <= 12 else np.zeros((rows_given, 6))
                    layer(handle.shard(local, 0))
                    seen.append("ok")
                except HpCpError as exc:
                    seen.append(str(exc))
        finally:
            disable_cp(handle)
        return seen

    per_rank = world.run(rank_fn)
    for seen in per_rank:
        assert seen[0] == "ok" and seen[2] == "ok", seen  # the same batch on every rank
        for error in (seen[1], seen[3]):  # another batch per rank; already sharded ids
            assert "digest of the batch handle.batch built per rank" in error, error
            assert "load the data by the data-parallel rank" in error, error
    assert per_rank[0][1] == per_rank[1][1] == per_rank[2][1]  # the same message everywhere


def test_handle_batch_refuses_bad_input(host: PluginHost) -> None:
    handle = enable_cp(make_layer(4, 5), fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    try:
        with pytest.raises(HpCpError, match=r"\[B, S\]"):
            handle.batch(np.zeros(8, dtype=np.int64))
        with pytest.raises(HpCpError, match="must have the shape of input_ids"):
            handle.batch(np.zeros((1, 8), np.int64), labels=np.zeros((1, 7), np.int64))
        with pytest.raises(HpCpError, match="needs batch size 1"):
            handle.batch(np.zeros((2, 8), np.int64), cu_seqlens=[0, 4, 8])
        with pytest.raises(PlanError, match="cu_seqlens"):
            handle.batch(np.zeros((1, 8), np.int64), cu_seqlens=[0, 4, 9])
    finally:
        disable_cp(handle)


def _config(layout: str):
    from hp_cp_core import CPConfig

    return CPConfig(layout=layout)


def test_cu_seqlens_from_a_stacks_packed_format():
    """The three packed formats a stack hands over (lengths, ids, per-document positions)
    give the same boundaries, and each bad input names itself."""
    from hp_cp_core import (
        HpCpError,
        cu_seqlens_from_ids,
        cu_seqlens_from_lengths,
        cu_seqlens_from_positions,
    )

    want = [0, 3, 3, 7, 12]
    lengths = np.array([[3, 0, 4, 5, -1000, -1000]])
    assert cu_seqlens_from_lengths(lengths, 12, unused=-1000).tolist() == want
    ids = np.repeat([1, 3, 2], [3, 4, 5])
    assert cu_seqlens_from_ids(ids, 12).tolist() == [0, 3, 7, 12]
    positions = np.concatenate([np.arange(3), np.arange(4), np.arange(5)])[None]
    assert cu_seqlens_from_positions(positions, 12).tolist() == [0, 3, 7, 12]
    assert cu_seqlens_from_positions(np.arange(12), 12) is None  # one document
    with pytest.raises(HpCpError, match="summing to the sequence length 13"):
        cu_seqlens_from_lengths(lengths, 13, unused=-1000)
    with pytest.raises(HpCpError, match="has 2 rows"):
        cu_seqlens_from_lengths(np.ones((2, 6)), 12)
    with pytest.raises(HpCpError, match="revisits a document"):
        cu_seqlens_from_ids(np.array([1, 1, 2, 1]), 4)
    with pytest.raises(HpCpError, match="11 entries"):
        cu_seqlens_from_ids(ids[:11], 12)
    with pytest.raises(HpCpError, match="must start at 0"):
        cu_seqlens_from_positions(positions + 1, 12)
    with pytest.raises(HpCpError, match="skip or repeat"):
        cu_seqlens_from_positions(np.array([[0, 1, 1, 2]]), 4)
    with pytest.raises(HpCpError, match="of 2 rows"):
        cu_seqlens_from_positions(np.zeros((2, 4)), 4)
