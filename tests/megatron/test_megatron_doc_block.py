"""docs/megatron.md's ``forward_step`` block, executed under Megatron's
``forward_backward_func`` at cp 2 (``nox -s megatron``): every parameter's gradient equals
the one-process step's to 1e-4 (``megatron_doc_cases``)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if "megatron" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import megatron.core  # noqa: F401 - must be importable: fail, not skip
else:
    pytest.importorskip("megatron.core", exc_type=ImportError)

import megatron_doc_cases  # noqa: E402 - after the skip

from hp_cp_torch.cli.launch import run_ranks  # noqa: E402


@pytest.mark.slow
def test_the_pages_forward_step_trains_as_one_process() -> None:
    """The block named ``"megatron-forward-step"``, run on 2 ranks."""
    for rank in run_ranks(2, megatron_doc_cases.doc_block_suite):
        errors = rank["grad_rel_err"]
        worst = max(errors, key=errors.get)
        assert len(errors) > 10 and errors[worst] <= 1e-4, (worst, errors[worst])
