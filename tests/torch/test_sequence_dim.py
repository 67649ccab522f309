"""A sequence-major model (``[S, B, hidden]``, Megatron's layout) declares
``ModelAdapter.sequence_dim = 0``: its adapter has no transpose and the layer under CP equals
one process; ``handle.shard`` along the batch by mistake raises the same ``HpCpError`` on
every rank before any exchange, naming the length cut and the length seen. One 2-rank job."""

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
