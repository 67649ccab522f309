"""Any sequence length under CP: the reference layer on lengths 1 .. 3*cp*r + 1 that the
layouts cannot shard as they are, padded by ``handle.shard(..., pad_value=...)`` (packed input:
the padding is its own trailing document), equals the UNPADDED single-device run on the real
rows: outputs, input and parameter gradients, the indexer loss and the indexer picks.

cp 2, 3, 4 (one 4-rank job, sub-groups), both layouts, a padded batch of 2 and packed
documents; r = 4 (every length at cp 2, the boundaries at cp 3 and 4) and r = 128 (1, r-1,
r+1, 3*cp*r + 1). See ``any_length_cases.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from any_length_cases import any_length_cases, any_length_suite, lengths
from cases import Case, build_layer, compare_selection, make_inputs, reference_selection, rel_err
from dist_utils import run_ranks

from hp_cp_core import pad_for_cp

pytestmark = pytest.mark.slow

CASES = any_length_cases()


@pytest.fixture(scope="module")
def suite() -> dict:
    return run_ranks(4, any_length_suite, timeout=600, pg_timeout=120)[0]


def single_device(case: Case) -> dict:
    """The unpadded sequence on one device (training mode: the indexer loss included); it
    does not depend on cp or the layout, so the cases that differ only there share it."""
    return _single_device(dataclasses.replace(case, cp=1, layout="contiguous"))


@functools.cache
def _single_device(case: Case) -> dict:
    layer = build_layer(case)
    x, cu, g = make_inputs(case)
    x.requires_grad_(True)
    out = layer(x, cu_seqlens=cu)
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad((out * g).sum(), [x, *params.values()], allow_unused=True)
    res = {
        "out": out.detach(),
        "gx": grads[0],
        "pgrads": dict(zip(params, grads[1:])),
        "indexer_loss": layer.indexer_loss,
    }
    if case.r == 4:
        res["sel"], res["scores"], res["slot_offset"] = reference_selection(layer, x.detach(), cu)
    return res


def test_the_grid_covers_the_issue() -> None:
    for cp in (2, 3, 4):
        for r in (4,):
            want = {1, r - 1, r, r + 1, 15, 3 * cp * r + 1}
            assert want <= set(lengths(cp, r))
        got = {(c.layout, c.packed) for c in CASES if c.cp == cp}
        assert len(got) == 4
        # most lengths really need padding under at least one layout
        padded = [c for c in CASES if c.cp == cp and pad_for_cp(c.total, cp, c.layout).pad_rows]
        assert len(padded) > len([c for c in CASES if c.cp == cp]) // 2
    assert set(lengths(2, 4)) == set(range(1, 26))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_padded_cp_matches_unpadded_single_device(suite: dict, case: Case) -> None:
    got = suite[case.name]
    assert not isinstance(got, str), got
    assert got["padded_rows"] == pad_for_cp(case.total, case.cp, case.layout).padded_rows
    want = single_device(case)
    assert got["out"].shape == want["out"].shape
    assert rel_err(got["out"], want["out"]) <= 1e-5
    assert rel_err(got["gx"], want["gx"]) <= 1e-4
    for name, ref in want["pgrads"].items():
        if ref is None:
            assert not got["pgrads"][name].abs().any(), name
        else:
            assert rel_err(got["pgrads"][name], ref) <= 1e-4, name
    if want["indexer_loss"] is not None:
        assert rel_err(got["indexer_loss"], want["indexer_loss"]) <= 1e-5
    if case.r == 4:
        rows, _ = compare_selection(got["sel"], want)
        assert rows == case.total * (1 if case.packed else 2)
