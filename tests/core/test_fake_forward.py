"""A full CP forward on the numpy fake backend equals the single-device toy layer.

The toy has a block-local compressor (overlapping for r = 4) and an index-set attention
(window + visible slots, indexer top-k for r = 4), so equality proves every row the core moves:
window halos, x halos, slot ownership, the gather order and the index arrays. r = 8 stands in
for HCA on short sequences; r = 128 runs too on longer ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fake_run import fake_host, make_layer, run_cp
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_cp_fake import fake_backend as fb

LAYOUTS = ("contiguous", "load_balanced")


def _docs(total: int, local: int, r: int) -> list[int]:
    """Packed boundaries with an empty document, ones shorter than r, and one longer than L."""
    lengths = [3, 0, local + r + 2, 1, max(r - 1, 1)]
    cu = [0]
    for n in lengths:
        if cu[-1] + n < total:
            cu.append(cu[-1] + n)
    return [*cu, total]


def _check(host, *, cp, total, r, window, layout, docs, topk=3, point_to_point=True) -> None:
    grid = "global" if docs == "packed-global" else "per_document"
    cu = None if docs == "padded" else np.array(_docs(total, total // cp, r))
    x = np.random.default_rng(cp * 1000 + total + r).normal(size=(total, 6))
    ref = fb.single_device(make_layer(r, window, grid, topk), x, cu)
    results = run_cp(
        host,
        cp=cp,
        x=x,
        r=r,
        window=window,
        layout=layout,
        cu=cu,
        grid=grid,
        topk=topk,
        point_to_point=point_to_point,
    )
    for rank, res in enumerate(results):
        np.testing.assert_allclose(res.full, ref, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
    if cp > 1:  # the CP path really ran: every rank exchanged halos (and slots point to point)
        slots = 1 if r and point_to_point else 0
        assert all(res.stats["collectives"].get("halo_exchange") == 1 for res in results)
        assert all(res.stats["collectives"].get("slot_exchange", 0) == slots for res in results)
        kind = "p2p" if point_to_point else "all_gather"
        assert all(res.stats["compressed_slot_exchange"] == kind for res in results)


@pytest.mark.parametrize("docs", ["padded", "packed-per_document", "packed-global"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("r", [0, 4, 8])
@pytest.mark.parametrize("cp", range(1, 9))
def test_cp_forward_equals_single_device(host, cp: int, r: int, layout: str, docs: str) -> None:
    # L = 10: not a multiple of r; W = 16 > L + 1, so the window halo spans two ranks back
    _check(host, cp=cp, total=10 * cp, r=r, window=16, layout=layout, docs=docs)


@pytest.mark.parametrize("docs", ["padded", "packed-per_document", "packed-global"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [2, 3, 5, 8])
def test_cp_forward_hca_ratio_128(host, cp: int, layout: str, docs: str) -> None:
    # L < r: every HCA slot straddles ranks; real window W = 128
    total = 2 * cp * (-(-400 // (2 * cp)))
    _check(host, cp=cp, total=total, r=128, window=128, layout=layout, docs=docs)


@pytest.mark.parametrize("docs", ["padded", "packed-per_document", "packed-global"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("r", [4, 8])
@pytest.mark.parametrize("cp", [2, 3, 8])
def test_cp_forward_all_gather_fallback(host, cp: int, r: int, layout: str, docs: str) -> None:
    """A group without point-to-point gets the compressed slots by all-gather: same result."""
    _check(
        host, cp=cp, total=10 * cp, r=r, window=16, layout=layout, docs=docs, point_to_point=False
    )


@settings(max_examples=40, deadline=None)
@given(
    cp=st.integers(2, 8),
    r=st.sampled_from([0, 4, 8]),
    chunk=st.integers(1, 9),
    window=st.integers(1, 24),
    layout=st.sampled_from(LAYOUTS),
    grid=st.sampled_from(["per_document", "global"]),
    lengths=st.lists(st.integers(0, 40), max_size=6),
    topk=st.integers(1, 5),
    point_to_point=st.booleans(),
)
def test_cp_forward_random_documents(
    cp, r, chunk, window, layout, grid, lengths, topk, point_to_point
):
    total = chunk * cp * (2 if layout == "load_balanced" else 1)
    cuts = [int(c) for c in np.cumsum(lengths) if 0 < c < total] if lengths else []
    cu = np.array([0, *cuts, total])
    x = np.random.default_rng(total).normal(size=(total, 6))
    ref = fb.single_device(make_layer(r, window, grid, topk), x, cu)
    results = run_cp(
        fake_host(),
        cp=cp,
        x=x,
        r=r,
        window=window,
        layout=layout,
        cu=cu,
        grid=grid,
        topk=topk,
        point_to_point=point_to_point,
    )
    for res in results:
        np.testing.assert_allclose(res.full, ref, rtol=1e-12, atol=1e-12)


def test_local_output_is_this_ranks_rows(host) -> None:
    """Each rank returns its own rows (in its layout's order), not the whole sequence."""
    cp, total = 4, 48
    x = np.random.default_rng(7).normal(size=(total, 6))
    ref = fb.single_device(make_layer(4, 8), x)
    results = run_cp(host, cp=cp, x=x, r=4, window=8, layout="load_balanced")
    chunk = total // (2 * cp)
    for rank, res in enumerate(results):
        rows = [*range(rank * chunk, (rank + 1) * chunk)]
        rows += [*range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]
        np.testing.assert_allclose(res.local, ref[rows], rtol=1e-12, atol=1e-12)
