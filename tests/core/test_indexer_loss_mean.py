"""hp_cp_core.indexer_loss: the global token-weighted mean, on in-process fake ranks."""

from __future__ import annotations

import numpy as np
import pytest

from hp_cp_core import DeepSeekV4CPConfig, DeepSeekV4CPContext, LayerSpec, build_rank_plan
from hp_cp_core.indexer_loss import global_indexer_loss, indexer_loss_weight
from hp_cp_fake.fake_backend import FakeGroup, FakeWorld


def _call(rank: int, cp: int, loss_rows: int, group=None) -> DeepSeekV4CPContext:
    spec = LayerSpec(compress_ratio=4, window_size=8, has_indexer=True)
    plan = build_rank_plan(
        rank=rank, cp_size=cp, spec=spec, layout_kind="contiguous", total_rows=8 * cp
    )
    return DeepSeekV4CPContext(
        cp_rank=rank,
        cp_size=cp,
        spec=spec,
        plan=plan,
        config=DeepSeekV4CPConfig(),
        group=group,
        loss_rows=loss_rows,
    )


def test_weight_is_one_over_all_ranks_rows() -> None:
    assert indexer_loss_weight(_call(0, 2, 10)) == pytest.approx(0.1)
    assert indexer_loss_weight(_call(1, 2, 0)) == 0.0  # every row masked: loss 0, no NaN


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_global_value_is_the_sum_of_shares_on_every_rank(cp: int) -> None:
    """Ranks with different row counts: the value is sum(KL) / N, not a mean of means."""
    kl_sums = [1.0 / (k + 1) + 1e-13 * k for k in range(cp)]  # bits must survive the trip
    rows = [4 + 5 * k for k in range(cp)]
    n = sum(rows)
    world = FakeWorld(cp)

    def rank_fn(rank: int) -> float:
        call = _call(rank, cp, n, FakeGroup(world, rank))
        return global_indexer_loss(call, kl_sums[rank] * indexer_loss_weight(call))

    got = world.run(rank_fn)
    want = float(np.sum([s * (1.0 / n) for s in kl_sums]))
    assert got == [want] * cp
    mean_of_means = float(np.mean([s / r for s, r in zip(kl_sums, rows)]))
    assert abs(want - mean_of_means) > 1e-3


def test_group_of_one_needs_no_collective() -> None:
    assert global_indexer_loss(_call(0, 1, 5, group=None), 0.25) == 0.25
