"""Every record belongs to its forward (Note [Records per forward] in hp_cp_core.records) in
NeMo Automodel 0.7.0's own DeepSeek V4, V4.1 (its Reuse / Reindex layers) and GLM-5 (its
shared indexer layers): with every decoder block recomputed in backward (NeMo's own
``apply_ac``, torch's ``checkpoint_wrapper`` reentrant and not), two forwards then their
backwards in both orders, or a forward, an evaluation forward of another batch, then the
first backward, through ``cp_nemo_batch``, give the loss and every gradient of one process
doing the same. One 3-rank gloo job (``nemo_order_cases.py``): cp 2 load-balanced, cp 3
contiguous.

NeMo's ``apply_ac`` is selective activation checkpointing (a policy that saves the router's
projection and top-k): its recomputation must run the very ops the forward ran, so a
recomputed layer agrees as its forward's call did (Note [A recomputation replays the
agreement] in hp_cp_core.records); GLM-5's two plain steps check the shared layers'
agreement, reused from layer 0's in the forward.
"""

from __future__ import annotations

import os

import pytest

if "nemo_automodel" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import nemo_automodel.components.models.deepseek_v4.model  # noqa: F401 - fail, not skip
else:
    pytest.importorskip("nemo_automodel.components.models.deepseek_v4.model", exc_type=ImportError)

import nemo_order_cases as oc  # noqa: E402 - after the skip
from dist_utils import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
TWO_STEPS = "fwd_bwd_fwd_bwd"  # forward, backward, forward, backward: nothing in between
MATRIX = (
    # (cp, layout, orders, modes)
    (2, "load_balanced", oc.ORDERS[:2], ("reentrant", "nonreentrant", "nemo_ac")),
    (2, "load_balanced", oc.ORDERS[2:], ("reentrant", "nemo_ac")),
    (2, "load_balanced", (TWO_STEPS,), ("nemo_ac",)),
    (3, "contiguous", ("fwd_fwd_bwdB_bwdA",), ("nonreentrant",)),
    (3, "contiguous", ("fwd_eval_bwd",), ("reentrant",)),
)
CASES = [
    (kind, cp, layout, order, mode)
    for kind in oc.MODELS
    for cp, layout, orders, modes in MATRIX
    for order in orders
    for mode in modes
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(3, oc.order_suite, CASES, timeout=900)[0]


def _name(case: tuple) -> str:
    kind, cp, layout, order, mode = case
    return f"{kind}-cp{cp}-{layout}-{order}-{mode}"


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_each_forward_reads_its_own_records(results: list[dict], case: tuple) -> None:
    [got] = [r for r in results if (r["kind"], r["cp"], r["layout"], r["order"], r["mode"]) == case]
    assert "error" not in got, got
    assert got["loss_err"] <= LOSS_RTOL, got
    assert got["grad_err"] <= GRAD_RTOL, got
    # freed with their graphs: at most the latest forward and the one backwarded last remain
    assert got["live_records"] <= 2, got
