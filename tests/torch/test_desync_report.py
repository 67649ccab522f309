"""The desync report (issue 12): when a CP collective times out because a peer skipped a
backward, the error on each waiting rank names the collective it waits in, its number and
layer, and what every peer last entered (see Note [Desync report] in
``hp_cp_torch/desync.py``). One 3-rank job, a two-layer stack under one handle, forward
collectives per layer: ``all_gather_meta``, ``halo_exchange``, ``slot_exchange`` (#1-#6)."""

from __future__ import annotations

import re

import pytest
from desync_cases import TIMEOUT_S

from hp_cp_torch.launch import run_ranks

pytestmark = pytest.mark.slow

WORLD = 3
LAST_FORWARD = "slot_exchange #6 (layer 1)"
FIRST_BACKWARD = r"slot_exchange backward #7 \(layer 1\)"
"""Backward runs the exchanges in reverse forward order (the order token): layer 1's slot
exchange first."""

_JOB: list = []


def _outcomes(name: str) -> list:
    if not _JOB:
        from cases import job

        _JOB.append(run_ranks(WORLD, job, "desync_cases:desync_suite", timeout=120, pg_timeout=30))
    per_rank = [r[name] for r in _JOB[0]]
    assert all(status == "ok" for status, _ in per_rank), per_rank
    return [value["error"] for _, value in per_rank]


def _report(error) -> str:
    assert error is not None, "the waiting rank did not raise"
    cls, msg = error
    assert cls == "HpCpError", msg
    m = re.search(r"Desync report: (.*?)\. Look for", msg)
    assert m, msg
    return m.group(1)


def test_the_waiting_rank_names_its_collective_and_where_the_peers_are() -> None:
    r0, r1, r2 = _outcomes("ranks_1_2_skip")
    assert r1 is None and r2 is None  # they skipped the backward: nothing to wait for
    report = _report(r0)
    assert re.fullmatch(
        rf"rank 0 waits in {FIRST_BACKWARD}; ranks 1-2 last entered {re.escape(LAST_FORWARD)}",
        report,
    ), report
    assert r0[1].startswith("CP collective ") and f"{TIMEOUT_S * 1000:.0f}ms" in r0[1]


def test_two_waiting_ranks_see_each_other_ahead_of_the_skipper() -> None:
    r0, r1, r2 = _outcomes("rank_2_skips")
    assert r2 is None
    for me, other, error in ((0, 1, r0), (1, 0, r1)):
        report = _report(error)
        m = re.fullmatch(
            rf"rank {me} waits in {FIRST_BACKWARD}; rank {other} last entered "
            rf"{FIRST_BACKWARD}; rank 2 last entered {re.escape(LAST_FORWARD)}",
            report,
        )
        assert m, report


def test_report_groups_peers_and_says_what_it_does_not_know() -> None:
    """In-process, on a ``HashStore``: ranks with the same record are grouped; a peer that
    entered nothing yet and one with no record at all are told apart."""
    import torch.distributed as dist

    from hp_cp_torch.desync import CollectiveLog

    store = dist.HashStore()
    logs = [CollectiveLog(k, 6, dist.PrefixStore("g/", store)) for k in range(5)]  # not rank 5
    for k in (1, 3, 4):
        logs[k].enter("halo_exchange", 0)
        logs[k].enter("all_gather", 0)
    where = logs[0].enter("all_gather_meta", 1)
    assert where == "all_gather_meta #1 (layer 1)"
    assert logs[0].report(where) == (
        "rank 0 waits in all_gather_meta #1 (layer 1); ranks 1, 3-4 last entered "
        "all_gather #2 (layer 0); rank 2 entered no CP collective of this group yet; rank 5: "
        "unknown (no record: its CP group was never created, or the store cannot be reached)"
    )
    assert CollectiveLog(0, 2, None).report("x #1") == (
        "rank 0 waits in x #1; rank 1: unknown (no record: its CP group was never created, or "
        "the store cannot be reached)"
    )
