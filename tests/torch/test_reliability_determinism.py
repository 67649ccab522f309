"""Determinism: the same inputs give bitwise-identical outputs and gradients, run after run.

For cp = 1, 2, 3 and 4 (one 4-rank job, the world split into blocks of cp ranks), every
ratio and layout, padded and packed, both attention kernels, ``autograd.grad`` and
``loss.backward()``, fp32 and bf16: three runs in one process (a fresh ``enable_cp``, the
same handle again with its plan cached, a fresh model and handle), the blocks running the
same case side by side, and a second job in fresh processes all give the same bits, also
with 4 intra-op threads per rank. At cp = 1 the CP-enabled layer equals the never-enabled one
bitwise (``torch.equal``). See ``reliability_cases.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from cases import Case, result
from reliability_cases import DETERMINISM_CPS, THREADED, WORLD, case_id, determinism_cases

pytestmark = pytest.mark.slow

SUITE_A = "reliability_cases:reliability_suite:a"
SUITE_B = "reliability_cases:reliability_suite:b"
CASES = [pytest.param(c, id=case_id(c)) for c in determinism_cases()]


def bitwise_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The entries that differ (with the largest difference), empty when all are equal."""
    out = sorted(set(got) ^ set(want))
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if not torch.equal(a, b):
            gap = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            out.append(f"{key} (max diff {gap})")
    return out


def members(case: Case, suite: str) -> list[dict]:
    per_rank = result(suite, WORLD, f"det:{case_id(case)}")
    ranks = [r for r in per_rank if r["member"]]
    assert len(ranks) == (WORLD // case.cp) * case.cp, "a block of ranks did not run the case"
    return ranks


@pytest.mark.parametrize("case", CASES)
def test_bitwise_identical_run_after_run(case: Case) -> None:
    for rank in members(case, SUITE_A):
        runs = rank["runs"]
        assert len(runs) == 3
        assert all(t.isfinite().all() for t in runs[0].values())
        for i, how in ((1, "same handle again"), (2, "fresh model and enable_cp")):
            diff = bitwise_diff(runs[i], runs[0])
            assert not diff, f"block {rank['block']} rank {rank['cp_rank']}, {how}: {diff}"


@pytest.mark.parametrize("case", CASES)
def test_bitwise_identical_across_groups_and_jobs(case: Case) -> None:
    """Blocks running the case at once agree, and so does a second job (fresh processes)."""
    first = {(r["block"], r["cp_rank"]): r["runs"][0] for r in members(case, SUITE_A)}
    again = {(r["block"], r["cp_rank"]): r["runs"] for r in members(case, SUITE_B)}
    for (block, k), run in first.items():
        diff = bitwise_diff(run, first[(0, k)])
        assert not diff, f"block {block} vs block 0, cp rank {k}: {diff}"
        assert len(again[(block, k)]) == 1
        diff = bitwise_diff(again[(block, k)][0], run)
        assert not diff, f"second job, block {block} cp rank {k}: {diff}"


@pytest.mark.parametrize("case", [p for p in CASES if p.values[0].cp == 1])
def test_cp1_bypass_equals_never_enabled_bitwise(case: Case) -> None:
    """With the default ``single_rank_bypass`` a group of one keeps the module's forward."""
    for rank in members(case, SUITE_A):
        diff = bitwise_diff(rank["bypass"], rank["plain"])
        assert not diff, f"rank {rank['block']}: bypassed cp = 1 differs from plain: {diff}"


def test_layer_and_kernels_bitwise_reproducible_with_threads() -> None:
    """With 4 intra-op threads, CPU scatter-adds run in parallel: the gathers' backward must
    not depend on thread timing (advanced indexing's did; see ``kernels.smallop.gather_rows``)."""
    from cases import layer_config

    from hp_cp_torch.kernels.efficient import sparse_attention_efficient
    from hp_cp_torch.kernels.smallop import sparse_attention_smallop
    from hp_cp_torch.reference import DeepSeekV4Attention

    def three_runs(name: str, fn, inputs: list[torch.Tensor]) -> None:
        runs = []
        for _ in range(3):
            leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
            out = fn(*leaves)
            wrt = [t for t in leaves if t.requires_grad]
            runs.append([out.detach(), *torch.autograd.grad(out.square().sum(), wrt)])
        for run in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(run, runs[0])), f"{name} differs"

    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        gen = torch.Generator().manual_seed(0)
        for r in (0, 4, 128):
            torch.manual_seed(r)
            layer = DeepSeekV4Attention(layer_config(r, 64, 8))
            three_runs(f"layer r = {r}", layer, [torch.randn(2, 256, 32, generator=gen)])
        q, pool = torch.randn(2, 256, 4, 32, generator=gen), torch.randn(2, 300, 32, generator=gen)
        idx = torch.randint(-1, 40, (2, 256, 48), generator=gen)  # many duplicate rows
        sink = torch.randn(4, generator=gen)
        for kernel in (sparse_attention_smallop, sparse_attention_efficient):
            fn = functools.partial(lambda k, a, b, s: k(a, b, idx, s, 0.2), kernel)
            three_runs(kernel.__name__, fn, [q, pool, sink])
    finally:
        torch.set_num_threads(previous)


def test_determinism_grid_covers_the_issue() -> None:
    cases = determinism_cases()
    assert {c.cp for c in cases} == set(DETERMINISM_CPS) >= {1, 2, 3, 4}
    assert {(c.r, c.layout, c.packed) for c in cases} == {
        (r, lay, p) for r in (0, 4, 128) for lay in ("contiguous", "load_balanced") for p in (0, 1)
    }
    for cp in DETERMINISM_CPS:
        assert {c.r for c in cases if c.cp == cp} == {0, 4, 128}
        assert {c.layout for c in cases if c.cp == cp} == {"contiguous", "load_balanced"}
    assert {c.kernel for c in cases} == {"smallop", "efficient"}
    assert {c.backward for c in cases} == {"grad", "backward"}
    assert len({case_id(c) for c in cases}) == len(cases)
    assert set(THREADED) <= set(cases) and min(THREADED.values()) > 1
