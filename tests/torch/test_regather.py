"""``DeepSeekV4CPConfig(regather_compressed_kv=True)``: the global compressed KV and indexer
keys are not kept for backward, the layer's backward receives them again.

Its cases run in the parity suite's job (``cases.regather_cases``: cp 2 and 8, r = 4 with
the indexer loss and r = 128, the default banded kernel), each next to its twin without the
option: with the option CP equals one device (outputs, the input gradient and every
parameter's gradient; ``test_torch_parity.py`` checks them with the rest of the grid), and
equals CP without it bit for bit, with the buffers' saved views really replaced.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cases import check_comm_counts, check_parity, regather_cases, result

pytestmark = pytest.mark.slow

PAIRS = [pytest.param(w, c, id=c.name) for w in (2, 8) for c in regather_cases(w) if c.regather]


@pytest.mark.parametrize(("world", "case"), PAIRS)
def test_regather_matches_one_device_and_cp_without_it(world, case) -> None:
    on = result("parity", world, case.name)
    off = result("parity", world, dataclasses.replace(case, regather=False).name)
    rank0_on = next(r for r in on if r["cp_rank"] == 0)
    rank0_off = next(r for r in off if r["cp_rank"] == 0)
    check_parity(case, rank0_on)  # outputs and every gradient against one device
    check_comm_counts(case, on)  # one more slot exchange, at the start of backward
    assert torch.equal(rank0_on["out"], rank0_off["out"])
    assert torch.equal(rank0_on["gx"], rank0_off["gx"])
    assert rank0_on["pgrads"].keys() == rank0_off["pgrads"].keys()
    for name, grad in rank0_off["pgrads"].items():
        assert torch.equal(rank0_on["pgrads"][name], grad), name
    if case.r == 4:
        assert torch.equal(rank0_on["sel"], rank0_off["sel"])
    # the kernels' saved buffers were kept as views (ranks whose buffer is not empty)
    assert sum(r["stats_bwd"]["regather_saved_views"] for r in on) > 0
    assert all(r["stats_bwd"]["regather_saved_views"] == 0 for r in off)


def test_regather_cases_have_twins() -> None:
    for world in (2, 8):
        names = {c.name for c in regather_cases(world)}
        for c in regather_cases(world):
            assert dataclasses.replace(c, regather=not c.regather).name in names
