"""A sequence-major model (``[S, B, hidden]``, Megatron's layout) declares
``ModelAdapter.sequence_dim = 0``: its adapter has no transpose and the layer under CP equals
one process; ``handle.shard`` along the batch by mistake raises the same ``HpCpError`` on
every rank before any exchange, naming the length cut and the length seen; the machinery
turns rows between layouts as views, never as copies. One 2-rank job."""

from __future__ import annotations

import pytest
import sequence_dim_cases as sc
from dist_utils import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(2, sc.sequence_dim_suite)


def test_a_sequence_major_layer_equals_one_process(results: list[dict]) -> None:
    for got in results:
        assert got["out_err"] <= 1e-5, got
        assert got["dx_err"] <= 1e-4, got
        assert got["grad_err"] <= 1e-4, got


def test_the_batch_sharded_by_mistake_raises_on_every_rank(results: list[dict]) -> None:
    messages = {got["wrong_dim"] for got in results}
    assert len(messages) == 1, messages  # the same error on every rank
    [message] = messages
    assert "cut from a sequence of 4 rows" in message, message
    assert "handle.shard(x, seq_dim)" in message, message


def test_the_cp_forward_copies_rows_only_into_its_messages(results: list[dict]) -> None:
    """Rows turn between the model's layout and the core's as views: under CP the forward
    makes the model's own layout copies (it makes them on one process too, once per
    contiguous run of rows under CP), the kernel's and the send buffers of its exchanges
    (window KV, main and indexer slots, at most), and nothing in the machinery between
    (runner, adapter dispatch, core) makes a transposed copy."""
    for got in results:
        one, cp = got["copies_one_process"], got["copies_under_cp"]
        assert set(cp) <= {"reference.py", "kernels/", "backend.py"}, cp
        assert set(one) == {"reference.py"}, one  # the model's own, on one process too
        assert cp.get("backend.py", 0) <= 3, cp
