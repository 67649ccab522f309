"""Any sequence length: the padding math (``pad_for_cp``), ``handle.shard(..., pad_value=...)``
and ``handle.unshard(..., rows=...)`` on the fake backend, and CP parity of the toy layer on
padded lengths (padded and packed) against its single-device definition."""

from __future__ import annotations

import numpy as np
import pytest
from _fake_run import make_layer

from hp_cp_core import CPPadding, DeepSeekV4CPConfig, PlanError, disable_cp, enable_cp, pad_for_cp
from hp_cp_core.layout import SequenceLayout
from hp_cp_core.plugins import PluginHost
from hp_cp_fake import fake_backend as fb


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_padding_is_the_least_the_layout_accepts(cp: int, layout: str) -> None:
    parts = cp * (2 if layout == "load_balanced" else 1)
    for rows in range(0, 5 * parts + 2):
        pad = pad_for_cp(rows, cp, layout)
        assert pad.rows == rows and pad.padded_rows >= rows
        SequenceLayout(layout, cp, pad.padded_rows)  # accepted
        shorter = [n for n in range(rows, pad.padded_rows) if n % parts == 0]
        assert shorter == [], (rows, pad)  # no shorter length is accepted
        assert pad.pad_rows < parts
        mask = pad.real_rows()
        assert mask.shape == (pad.padded_rows,) and int(mask.sum()) == rows
        assert mask[:rows].all()


def test_packed_boundaries_get_a_trailing_padding_document() -> None:
    pad = pad_for_cp(7, 2, "load_balanced")
    assert pad == CPPadding(7, 8) and pad.pad_rows == 1
    assert pad.cu_seqlens([0, 3, 7]).tolist() == [0, 3, 7, 8]
    assert pad.cu_seqlens(None).tolist() == [0, 8]
    fits = pad_for_cp(8, 2, "load_balanced")
    assert fits.cu_seqlens(np.array([0, 5, 8])).tolist() == [0, 5, 8]  # nothing added
    with pytest.raises(PlanError, match="must end at the sequence's 7 real rows"):
        pad.cu_seqlens([0, 3, 8])


def test_bad_padding_requests_raise() -> None:
    with pytest.raises(PlanError, match="cannot have -1 rows"):
        pad_for_cp(-1, 2)
    with pytest.raises(PlanError, match="layout must be"):
        pad_for_cp(5, 2, "zigzag")
    with pytest.raises(PlanError, match="cp size must be >= 1"):
        pad_for_cp(5, 0)


def test_shard_without_pad_value_names_the_fix(host: PluginHost) -> None:
    handle = enable_cp(make_layer(4, 5), fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    try:
        with pytest.raises(PlanError, match=r"pad_value=\.\.\."):
            handle.shard(np.zeros((7, 3)), 0)
    finally:
        disable_cp(handle)


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
def test_shard_pads_and_unshard_trims(host: PluginHost, layout: str) -> None:
    cp, rows = 3, 8
    world = fb.FakeWorld(cp)
    x = np.arange(2 * rows, dtype=np.float64).reshape(1, rows, 2) + 1

    def rank_fn(rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        layer = make_layer(0, 4)
        handle = enable_cp(
            layer, fb.FakeMesh(world, rank), DeepSeekV4CPConfig(layout), plugins=host
        )
        try:
            local = handle.shard(x, 1, pad_value=-7)
            mask = handle.shard(np.ones((1, rows)), 1, pad_value=0)
            back = handle.unshard(local, 1, rows=rows)
            padded = handle.unshard(local, 1)
        finally:
            disable_cp(handle)
        return local, mask, back, padded

    results = world.run(rank_fn)
    padded_rows = pad_for_cp(rows, cp, layout).padded_rows
    for local, mask, back, padded in results:
        assert local.shape == (1, padded_rows // cp, 2)
        assert np.array_equal(back, x)
        assert padded.shape == (1, padded_rows, 2)
        assert (padded[0, rows:] == -7).all()
        assert int(mask.sum()) == ((local != -7).all(-1)).sum()
    assert sum(int(m.sum()) for _, m, _, _ in results) == rows


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("cp", "r"), [(2, 4), (3, 4), (4, 128), (3, 0)])
def test_toy_layer_on_any_length_matches_single_device(
    host: PluginHost, cp: int, r: int, layout: str, packed: bool
) -> None:
    window = 5
    top = 3 * cp * max(r, 1) + 1 if r != 128 else 2 * 128 + 3
    lengths = sorted({1, 2, 3, 4, 5, window - 1, 2 * cp - 1, 2 * cp + 1, top - 2, top})
    for rows in lengths:
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, 6))
        cu = None
        if packed:
            cuts = np.sort(rng.choice(np.arange(1, rows), size=min(2, rows - 1), replace=False))
            cu = np.array([0, *cuts.tolist(), rows])
        want = fb.single_device(make_layer(r, window), x, cu)
        world = fb.FakeWorld(cp)

        def rank_fn(rank: int, x=x, cu=cu, rows=rows) -> np.ndarray:
            layer = make_layer(r, window)
            config = DeepSeekV4CPConfig(layout=layout)
            handle = enable_cp(layer, fb.FakeMesh(world, rank), config, plugins=host)
            try:
                pad = handle.padding(rows)
                cu_pad = pad.cu_seqlens(cu) if packed else None
                out = layer(handle.shard(x, 0, pad_value=0.0), cu_seqlens=cu_pad)
                return handle.unshard(out, 0, rows=rows)
            finally:
                disable_cp(handle)

        for got in world.run(rank_fn):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"S={rows}")


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
def test_shard_records_the_padding_the_indexer_loss_leaves_out(
    host: PluginHost, layout: str
) -> None:
    cp, rows = 2, 7
    world = fb.FakeWorld(cp)

    def rank_fn(rank: int) -> tuple:
        handle = enable_cp(
            make_layer(0, 4), fb.FakeMesh(world, rank), DeepSeekV4CPConfig(layout), plugins=host
        )
        try:
            assert handle.sequence.padding is None
            handle.shard(np.zeros((1, rows, 2)), 1, pad_value=0)
            recorded = handle.sequence.padding
            padded = handle.layout(recorded.padded_rows)
            real = handle.sequence.real_rows(layout, cp, rank, recorded.padded_rows)
            other = handle.sequence.real_rows(layout, cp, rank, 12)  # another length
            assert handle.sequence.real_rows(layout, cp, rank, 7) is None  # never raises
            handle.shard(np.arange(recorded.padded_rows), 0)  # positions: the same sequence
            kept = handle.sequence.padding
            handle.shard(np.zeros((1, 12, 2)), 1)  # another length, no pad_value: forgotten
            forgot = handle.sequence.padding
            handle.shard(np.zeros((1, 7, 2)), 1, pad_value=0)
            handle.shard(np.zeros((1, 8, 2)), 1, pad_value=0)  # fits: nothing padded
            after = handle.sequence.real_rows(layout, cp, rank, 8)
            assert kept == recorded and forgot is None
        finally:
            disable_cp(handle)
        return recorded, padded.shard_index(rank), real, other, after

    results = world.run(rank_fn)
    pad = pad_for_cp(rows, cp, layout)
    seen = []
    for recorded, index, real, other, after in results:
        assert recorded == pad
        assert real is not None and real.tolist() == (index < rows).tolist()
        assert other is None and after is None
        seen += index[real].tolist()
    assert sorted(seen) == list(range(rows))  # every real row counted once, no padding row
