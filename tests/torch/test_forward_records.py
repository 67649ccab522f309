"""Every record belongs to its forward (Note [Records per forward] in hp_cp_core.records):
with activation recomputation (transformers' ``gradient_checkpointing_enable`` and
``torch.utils.checkpoint``, reentrant and not), two forwards then their backwards in both
orders, or a forward, an evaluation forward of another batch, then the first backward,
give the gradients of one process doing the same; HF DeepSeek V4, V3.2, GLM-5 (its shared
indexer layers) and the reference layers (the indexer loss leaves each batch's own padding
out), also each in torch's ``checkpoint_wrapper`` under FSDP2 over the CP ranks. One 3-rank
gloo job (``forward_order_cases.py``): cp 2 load-balanced, cp 3 contiguous.
"""

from __future__ import annotations

import os

import pytest

if "transformers" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import transformers.models.glm_moe_dsa  # noqa: F401 - must be importable: fail, not skip
else:
    pytest.importorskip("transformers.models.glm_moe_dsa", exc_type=ImportError)

import forward_order_cases as fc  # noqa: E402 - after the skip
from dist_utils import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
CASES = [
    (kind, cp, layout, order, reentrant)
    for kind in fc.MODELS
    for cp, layout, orders, modes in (
        (2, "load_balanced", fc.ORDERS, (False, True)),
        (3, "contiguous", ("fwd_fwd_bwdB_bwdA",), (False,)),
        (3, "contiguous", ("fwd_eval_bwd",), (True,)),
    )
    for order in orders
    for reentrant in modes
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(3, fc.order_suite, fc.MODELS, CASES, timeout=1200)[0]


def _name(case: tuple) -> str:
    kind, cp, layout, order, reentrant = case
    return f"{kind}-cp{cp}-{layout}-{order}-{'reentrant' if reentrant else 'nonreentrant'}"


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_each_forward_reads_its_own_records(results: list[dict], case: tuple) -> None:
    kind, cp, layout, order, reentrant = case
    [got] = [
        r
        for r in results
        if "kind" in r and (r["kind"], r["cp"], r["layout"], r["order"], r["reentrant"]) == case
    ]
    assert got["loss_err"] <= LOSS_RTOL, got
    assert got["grad_err"] <= GRAD_RTOL, got
    # freed with their graphs: the latest forward's is kept, and at most the one backwarded
    # last besides (what the reference layers and FSDP2 keep of their last call until the
    # next); never one per forward
    assert got["live_records"] <= (2 if kind.startswith("reference") else 1), got


def test_a_recomputation_whose_forward_cannot_be_found_raises(results: list[dict]) -> None:
    [got] = [r["unfindable"] for r in results if "unfindable" in r]
    assert "could not be found" in got, got
