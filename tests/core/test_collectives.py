"""Collective counts and bytes of one CP layer forward on the fake backend.

One forward does exactly one ``exchange_rows`` of halos (window KV and x in one message per
peer), one more of compressed slots (main and indexer together) when r > 0 (or, on a group
without point-to-point, one ``all_gather_rows`` instead), and the one meta all-gather of the
input check. The bytes logged equal rows x row bytes from the plan, and the rows and slots
received are exactly those the brute-force definitions say the rank reads.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _brute import World
from _fake_run import run_cp

from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_fake import fake_backend as fb

HIDDEN, D = 6, 5  # the toy's x row and KV row widths (float64)
X_ROW, KV_ROW = HIDDEN * 8, D * 8


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(rank, kind) of every meta / dim all-gather (the fake logs only the layer exchanges)."""
    calls: list[tuple[int, str]] = []
    lock = threading.Lock()
    for kind in ("all_gather_meta", "all_gather_dim"):
        original = getattr(fb.FakeGroup, kind)

        def counting(self, *args, _original=original, _kind=kind, **kwargs):
            with lock:
                calls.append((self.rank, _kind))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(fb.FakeGroup, kind, counting)
    return calls


CASES = [
    # cp, total, r, W, layout, cu, grid
    (2, 40, 0, 16, "contiguous", None, "per_document"),
    (3, 36, 4, 16, "contiguous", None, "per_document"),
    (4, 40, 4, 16, "load_balanced", [0, 3, 3, 20, 21, 40], "per_document"),
    (5, 50, 4, 7, "contiguous", [0, 3, 3, 20, 21, 50], "global"),
    (8, 96, 8, 30, "load_balanced", None, "per_document"),
    (8, 96, 8, 30, "contiguous", [0, 2, 50, 51, 96], "global"),
    (6, 480, 128, 128, "load_balanced", [0, 100, 101, 400, 480], "per_document"),
    (7, 490, 128, 128, "contiguous", None, "per_document"),
]


@pytest.mark.parametrize("p2p", [True, False], ids=["p2p", "all_gather"])
@pytest.mark.parametrize("cp, total, r, window, layout, cu, grid", CASES)
def test_one_forward_collectives_and_bytes(
    host, counted, cp, total, r, window, layout, cu, grid, p2p
):
    x = np.random.default_rng(0).normal(size=(total, HIDDEN))
    cu_arr = None if cu is None else np.array(cu)
    results = run_cp(
        host,
        cp=cp,
        x=x,
        r=r,
        window=window,
        layout=layout,
        cu=cu_arr,
        grid=grid,
        point_to_point=p2p,
    )
    spec = LayerSpec(compress_ratio=r, window_size=window, has_indexer=r == 4, packed_grid=grid)
    world = World(
        total_rows=total, cp=cp, layout=layout, r=r, window=window, cu_seqlens=cu, grid=grid
    )
    row = D * 8 * (2 if r == 4 else 1)  # main slot (+ indexer key) per slot row
    for rank, res in enumerate(results):
        kinds = [e["kind"] for e in res.log]
        names = [e["name"] for e in res.log]
        slots = ("slot_exchange" if p2p else "all_gather") if r else None
        assert names == ["halo_exchange", *([slots] if slots else [])]
        assert kinds.count("exchange_rows") == (2 if r and p2p else 1)
        assert kinds.count("all_gather_rows") == (1 if r and not p2p else 0)
        assert len(kinds) == 1 + (1 if r else 0)
        assert res.stats["compressed_slot_exchange"] == ("p2p" if p2p else "all_gather")
        assert counted.count((rank, "all_gather_meta")) == 1
        assert counted.count((rank, "all_gather_dim")) == 1  # handle.unshard, not the layer

        plan = build_rank_plan(
            rank=rank,
            cp_size=cp,
            spec=spec,
            layout_kind=layout,
            total_rows=total,
            cu_seqlens=cu_arr,
        )
        ex = next(e for e in res.log if e["name"] == "halo_exchange")
        sent = sum(s.size for s in plan.window.send_rows) * KV_ROW
        recv = sum(plan.window.recv_counts) * KV_ROW
        if r:
            sent += sum(s.size for s in plan.x.send_rows) * X_ROW
            recv += sum(plan.x.recv_counts) * X_ROW
        assert (ex["sent"], ex["recv"]) == (sent, recv)
        # ... and the received rows are exactly what this rank reads (brute force)
        need = len(world.window_halo(rank)) * KV_ROW
        need += len(world.x_halo(rank)) * X_ROW if r else 0
        assert ex["recv"] == need

        if r and p2p:  # exactly the remote slots this rank's queries see, once each
            sx = next(e for e in res.log if e["name"] == "slot_exchange")
            assert sx["sent"] == plan.slot_exchange.send_total * row
            assert sx["recv"] == plan.slot_exchange.n_halo * row
            assert sx["recv"] == len(world.slot_halo(rank)) * row
        elif r:
            ag = next(e for e in res.log if e["kind"] == "all_gather_rows")
            assert plan.gather_cap == max(len(world.owned(k)) for k in range(cp))
            assert ag["sent"] == plan.gather_cap * row
            assert ag["recv"] == plan.gather_cap * row * (cp - 1)

        assert res.stats["bytes_sent"] == sum(e["sent"] for e in res.log)
        assert res.stats["bytes_recv"] == sum(e["recv"] for e in res.log)
        assert res.stats["collectives"] == {k: names.count(k) for k in set(names)}


def test_symmetric_exchange_even_when_a_rank_needs_nothing(host) -> None:
    """W = 1 and r = 0: no halo at all, yet every rank still joins the one exchange."""
    x = np.random.default_rng(1).normal(size=(24, HIDDEN))
    results = run_cp(host, cp=4, x=x, r=0, window=1)
    for res in results:
        assert [(e["kind"], e["sent"], e["recv"]) for e in res.log] == [("exchange_rows", 0, 0)]


@pytest.mark.parametrize("p2p", [True, False], ids=["p2p", "all_gather"])
def test_traffic_totals_balance(host, p2p) -> None:
    """What all ranks send equals what all ranks receive, in every collective."""
    x = np.random.default_rng(2).normal(size=(64, HIDDEN))
    results = run_cp(host, cp=4, x=x, r=4, window=20, layout="load_balanced", point_to_point=p2p)
    names = ("halo_exchange", "slot_exchange") if p2p else ("halo_exchange", "all_gather")
    for name in names:
        sent = sum(e["sent"] for res in results for e in res.log if e["name"] == name)
        recv = sum(e["recv"] for res in results for e in res.log if e["name"] == name)
        assert sent > 0
        if name == "all_gather":
            assert recv == sent * (4 - 1)
        else:
            assert sent == recv
