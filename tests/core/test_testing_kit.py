"""The backend author's kit (``hp_cp_core.testing``): the thread world's collective semantics,
its failure modes (no hang), traces, and the numpy exchanges' backward as exact adjoints."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hp_cp_core import HpCpError
from hp_cp_core.plan import build_rank_plan
from hp_cp_core.stats import check_stats
from hp_cp_core.testing import (
    CollectiveMismatchError,
    PeerFailedError,
    ThreadGroup,
    ThreadWorld,
    rel_err,
)


def test_all_gather_and_exchange_deliver_what_peers_sent() -> None:
    world = ThreadWorld(3)

    def rank_fn(rank: int):
        gathered = world.all_gather(rank, "g", rank * 10)
        got = world.exchange(rank, "x", {(rank + 1) % 3: f"{rank}->{(rank + 1) % 3}"})
        return gathered, got

    out = world.run(rank_fn)
    assert [g for g, _ in out] == [[0, 10, 20]] * 3
    assert [x for _, x in out] == [{2: "2->0"}, {0: "0->1"}, {1: "1->2"}]
    assert world.traces() == [["g", "x"]] * 3


def test_different_collectives_at_one_step_raise_on_every_rank() -> None:
    world = ThreadWorld(2, timeout=10)

    def rank_fn(rank: int):
        return world.all_gather(rank, "all_gather_bwd" if rank else "halo_exchange_bwd", 0)

    got = world.run(rank_fn, return_exceptions=True)
    assert all(isinstance(e, CollectiveMismatchError) for e in got), got
    assert "rank 0 in 'halo_exchange_bwd', rank 1 in 'all_gather_bwd'" in str(got[0])
    with pytest.raises(CollectiveMismatchError):
        world.run(rank_fn)


def test_a_rank_that_raises_releases_its_peers() -> None:
    world = ThreadWorld(3, timeout=60)

    def rank_fn(rank: int):
        if rank == 1:
            raise ValueError("boom on rank 1")
        world.all_gather(rank, "all_gather", rank)

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="boom on rank 1"):  # the cause, not the peers' abort
        world.run(rank_fn)
    assert time.perf_counter() - t0 < 30
    got = world.run(rank_fn, return_exceptions=True)
    assert isinstance(got[1], ValueError)
    for k in (0, 2):
        assert isinstance(got[k], PeerFailedError) and isinstance(got[k], HpCpError)
        assert "rank 1 raised ValueError: boom on rank 1" in str(got[k])


def test_a_rank_that_skips_a_collective_times_its_peers_out() -> None:
    world = ThreadWorld(2, timeout=0.5)

    def rank_fn(rank: int):
        world.all_gather(rank, "meta", 0)
        if rank == 0:
            world.all_gather(rank, "all_gather_bwd", 0)  # rank 1 skipped this backward

    got = world.run(rank_fn, return_exceptions=True)
    assert isinstance(got[0], PeerFailedError)
    assert "timed out" in str(got[0]) and "rank 1 last entered 'meta' #1" in str(got[0])
    assert got[1] is None


def test_the_world_rejects_no_ranks() -> None:
    with pytest.raises(HpCpError, match="positive number of ranks"):
        ThreadWorld(0)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
def test_numpy_exchanges_backward_is_the_adjoint(cp: int, layout: str) -> None:
    """<forward(a), g> == <a, backward(g)> for the halo exchange and the all-gather, so a
    backend wrapping them in autograd gets exact gradients."""
    from hp_cp_core import LayerSpec

    spec = LayerSpec(compress_ratio=4, window_size=8, has_indexer=True)
    world = ThreadWorld(cp)
    rng = np.random.default_rng(cp)
    rows = 2 * cp * 3

    def rank_fn(rank: int):
        plan = build_rank_plan(
            rank=rank, cp_size=cp, spec=spec, layout_kind=layout, total_rows=rows
        )
        group = ThreadGroup(world.mesh(rank))
        plans = [plan.window] + ([plan.x] if plan.x is not None else [])
        arrays = [rng.standard_normal((rows // cp, 2, 3)) for _ in plans]
        outs = group.exchange_rows_np(arrays, plans)
        grads_out = [rng.standard_normal(o.shape) for o in outs]
        grads_in = group.exchange_rows_backward_np(grads_out, plans)
        lhs = sum(float((o * g).sum()) for o, g in zip(outs, grads_out))
        rhs = sum(float((a * g).sum()) for a, g in zip(arrays, grads_in))
        cap = rng.standard_normal((2, 4))
        gathered = group.all_gather_rows_np(cap)
        dg = rng.standard_normal(gathered.shape)
        lhs += float((gathered * dg).sum())
        rhs += float((cap * group.all_gather_rows_backward_np(dg)).sum())
        return lhs, rhs, group.stats(), world.trace(rank)

    out = world.run(rank_fn)
    lhs, rhs = sum(o[0] for o in out), sum(o[1] for o in out)  # a global inner product
    assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs))
    for _, _, stats, trace in out:
        assert not check_stats(stats)
        assert stats["collectives"] == {
            "halo_exchange": 1,
            "halo_exchange_bwd": 1,
            "all_gather": 1,
            "all_gather_bwd": 1,
        }
        assert trace == ["halo_exchange", "halo_exchange_bwd", "all_gather", "all_gather_bwd"]


def test_rel_err() -> None:
    assert rel_err([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert rel_err([1.0, 2.5], [1.0, 2.0]) == pytest.approx(0.25)
    assert rel_err(np.zeros(0), np.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        rel_err([1.0], [1.0, 2.0])


def test_the_kit_imports_no_framework_and_no_pytest() -> None:
    import subprocess
    import sys

    code = (
        "import sys, hp_cp_core.testing, hp_cp_core.testing.cases; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'pytest', 'torch', 'mindspore', "
        "'jax'}); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
