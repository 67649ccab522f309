"""The core's plan for shifting a sharded sequence by whole rows (MTP's ``roll_tensor``): every
rank's rows of the shifted sequence, built from its own rows and the gathered chunk edges,
equal the shift of the whole sequence, for both layouts, every cp and shifts up and down."""

from __future__ import annotations

import numpy as np
import pytest

from hp_cp_core import PlanError
from hp_cp_core.layout import SequenceLayout
from hp_cp_core.shift import shift_plan


def shifted(x: np.ndarray, shift: int) -> np.ndarray:
    out = np.zeros_like(x)
    n = x.size
    for g in range(n):
        if 0 <= g - shift < n:
            out[g] = x[g - shift]
    return out


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shift", [-1, -2, -3, 1, 3, 0])
def test_every_rank_gets_its_rows_of_the_shifted_sequence(layout: str, cp: int, shift: int) -> None:
    parts = cp * (2 if layout == "load_balanced" else 1)
    for chunk in (3, 4):
        total = parts * chunk
        lay = SequenceLayout(layout, cp, total)
        x = np.arange(total) + 100
        plans = [shift_plan(lay, r, shift) for r in range(cp)]
        assert len({p.send.size for p in plans}) == 1  # the same all-gather on every rank
        gathered = np.concatenate([x[lay.rank_rows(r)][p.send] for r, p in enumerate(plans)])
        want = shifted(x, shift)
        for r, plan in enumerate(plans):
            pool = np.concatenate([x[lay.rank_rows(r)], gathered, [0]])
            assert pool[plan.take].tolist() == want[lay.rank_rows(r)].tolist(), (r, chunk)
        assert all(p.needs_exchange == (cp > 1 and shift != 0) for p in plans)


def test_a_shift_past_a_chunk_is_refused() -> None:
    lay = SequenceLayout("load_balanced", 2, 8)  # chunks of 2 rows
    shift_plan(lay, 0, -2)
    with pytest.raises(PlanError, match="at most 2 rows"):
        shift_plan(lay, 0, -3)
    shift_plan(SequenceLayout("contiguous", 1, 8), 0, -5)  # one rank: any shift
