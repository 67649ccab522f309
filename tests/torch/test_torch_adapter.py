"""``patch_torch_deepseek_v4_csa_forward`` on a module that looks nothing like the reference
layer: ``module(query, key, x, qr)`` on sequence-major padded tensors, compressors and an
attention function in place of attributes (``cases.SeqMajorCSA``). Under CP it equals its
single-device forward for r 0, 4, 128 and both layouts; under load-balanced sharding the
adapter calls ``attention_fn`` once per contiguous run."""

from __future__ import annotations

import pytest
from cases import AdapterCase, adapter_cases, check_adapter_parity, result

pytestmark = pytest.mark.slow

WORLDS = (2, 3)
PARAMS = [pytest.param(w, c, id=c.name) for w in WORLDS for c in adapter_cases(w)]


@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_patched_module_matches_single_device(world: int, case: AdapterCase) -> None:
    per_rank = result("adapter", world, case.name)
    rank0 = next(r for r in per_rank if r["cp_rank"] == 0)
    check_adapter_parity(case, rank0)
    chunk = case.total // (2 * case.cp)
    for r in per_rank:
        assert r["restored"], "disable_cp left the patched forward in place"
        fwd = r["stats"]["collectives"]
        assert fwd == {"halo_exchange": 1, **({"slot_exchange": 1} if case.r else {})}, fwd
        k = r["cp_rank"]
        offsets = [pos for pos, _, _ in r["calls"]]
        if case.layout == "load_balanced":  # one call per chunk: k and 2cp-1-k
            assert offsets == [k * chunk, (2 * case.cp - 1 - k) * chunk], r["calls"]
        else:
            assert offsets == [k * 2 * chunk], r["calls"]
        for pos, halo, n in r["calls"]:
            assert halo == min(pos, case.window - 1), r["calls"]  # padded: the whole window
            assert n == (chunk if case.layout == "load_balanced" else 2 * chunk)
