"""Randomised end-to-end parity against the single-device reference layer.

In the torch session: a fixed seed and :data:`fuzz_cases.DEFAULT_CASES` cases over cp 2 and
4. ``nox -s fuzz`` runs many more with a random seed (printed; set ``HP_CP_FUZZ_SEED``,
``HP_CP_FUZZ_CASES``, ``HP_CP_FUZZ_WORLDS`` to choose). Cases come from ``fuzz_cases.py``;
the checks are the parity suite's (``cases.check_parity``: fp32 outputs 1e-5, gradients 1e-4,
indexer picks tie-aware).
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import Case, check_parity, result
from fuzz_cases import batches, fuzz_cases, reproduce_hint, settings

from hp_cp_core import LayerSpec
from hp_cp_core.layout import SequenceLayout
from hp_cp_core.plan import build_rank_plan

pytestmark = pytest.mark.slow

PARAMS = [
    pytest.param(cp, b, name, case, id=name)
    for cp in sorted(set(settings()[2]))
    for b, batch in enumerate(batches(cp))
    for name, case in batch
]


@pytest.mark.parametrize(("world", "batch", "name", "case"), PARAMS)
def test_random_case_matches_single_device(world: int, batch: int, name: str, case: Case) -> None:
    try:
        per_rank = result(f"fuzz_cases:fuzz_suite:{batch}", world, name)
        rank0 = next(r for r in per_rank if r["cp_rank"] == 0)
        check_parity(case, rank0)
    except AssertionError as exc:
        raise AssertionError(f"{name}: {exc}\n{case}\n{reproduce_hint(name)}") from exc


@pytest.mark.parametrize("seed", [0, 1, 2, settings()[0]])
def test_generated_cases_are_valid_and_varied(seed: int) -> None:
    """Every case shards and plans on every rank; a short list still has every ratio,
    layout and input kind, and some L < W - 1, L % r != 0, empty documents, top-k > 3."""
    cases = [c for _, c in fuzz_cases(seed, 60, (2, 3, 4, 8))]
    for case in cases:
        SequenceLayout(case.layout, case.cp, case.total)  # raises if not shardable
        cu = None if case.cu is None else np.array(case.cu)
        if cu is not None:
            assert cu[0] == 0 and cu[-1] == case.total and (np.diff(cu) >= 0).all()
        spec = LayerSpec(compress_ratio=case.r, window_size=case.window, has_indexer=case.r == 4)
        for rank in range(case.cp):
            build_rank_plan(
                rank=rank,
                cp_size=case.cp,
                spec=spec,
                layout_kind=case.layout,
                total_rows=case.total,
                cu_seqlens=cu,
            )
    assert {(c.r, c.layout, c.packed) for c in cases[:12]} == {
        (r, lay, p) for r in (0, 4, 128) for lay in ("contiguous", "load_balanced") for p in (0, 1)
    }
    assert {c.cp for c in cases} == {2, 3, 4, 8}
    assert any(c.local < c.window - 1 for c in cases)
    assert any(c.r and c.local % c.r for c in cases)
    assert any(c.cu and 0 in np.diff(c.cu) for c in cases)
    assert any(c.r == 4 and c.topk > 3 for c in cases)
    assert len({name for name, _ in fuzz_cases(seed, 60, (2, 4))}) == 60


def test_ci_fuzz_list_is_bounded() -> None:
    """The torch session's default: a fixed seed, about 20 cases over cp 2 and 4."""
    seed, n, cps = settings()
    if n > 40:
        pytest.skip(f"a long fuzz run (HP_CP_FUZZ_CASES={n}, seed {seed})")
    assert {c.cp for _, c in fuzz_cases()} <= {2, 3, 4, 8}
    assert max(c.total for _, c in fuzz_cases()) <= 640
