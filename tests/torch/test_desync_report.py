"""The desync report (issue 12): when a CP collective times out because a peer skipped a
backward, the error on each waiting rank names the collective it waits in, its number and
layer, and what every peer last entered (see Note [Desync report] in
``hp_cp_torch/distributed/desync.py``). One 3-rank job, a two-layer stack under one handle: two
healthy training steps, then a forward whose backward some ranks skip. Each layer's forward ends in
its ``slot_exchange``; the store is counted: untouched until the failure."""

from __future__ import annotations

import re

import pytest
from desync_cases import TIMEOUT_S

from hp_cp_torch.cli.launch import run_ranks

pytestmark = pytest.mark.slow

WORLD = 3
LAST_FORWARD = r"slot_exchange #(\d+) \(layer 1\)"
FIRST_BACKWARD = r"slot_exchange backward #(\d+) \(layer 1\)"
"""Backward runs the exchanges in reverse forward order (the order token): layer 1's slot
exchange first, numbered one after the forward's last."""

_JOB: list = []


def _outcomes(name: str) -> list:
    if not _JOB:
        from cases import job

        _JOB.append(run_ranks(WORLD, job, "desync_cases:desync_suite", timeout=120, pg_timeout=30))
    per_rank = [r[name] for r in _JOB[0]]
    assert all(status == "ok" for status, _ in per_rank), per_rank
    for _, value in per_rank:  # the flight recorder: no store traffic while all goes well
        assert value["ops_before"] == 0, value
        assert value["ops"] > 0, value  # the failure (or disable_cp) published the record
    return [value["error"] for _, value in per_rank]


def _numbers(match: re.Match) -> list[int]:
    return [int(g) for g in match.groups()]


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
    m = re.fullmatch(
        rf"rank 0 waits in {FIRST_BACKWARD}; ranks 1-2 last entered {LAST_FORWARD}", report
    )
    assert m, report
    waits, last = _numbers(m)
    assert waits == last + 1, report
    assert r0[1].startswith("CP collective ") and f"{TIMEOUT_S * 1000:.0f}ms" in r0[1]


def test_two_waiting_ranks_see_each_other_ahead_of_the_skipper() -> None:
    r0, r1, r2 = _outcomes("rank_2_skips")
    assert r2 is None
    for me, other, error in ((0, 1, r0), (1, 0, r1)):
        report = _report(error)
        m = re.fullmatch(
            rf"rank {me} waits in {FIRST_BACKWARD}; rank {other} last entered "
            rf"{FIRST_BACKWARD}; rank 2 last entered {LAST_FORWARD}",
            report,
        )
        assert m, report
        waits, other_waits, last = _numbers(m)
        assert waits == other_waits == last + 1, report


def test_report_groups_peers_and_says_what_it_does_not_know() -> None:
    """In-process, on a ``HashStore``: nothing reaches the store until a rank publishes
    (failure, or disable_cp); ranks with the same record are grouped; a peer that entered
    nothing yet and one with no record at all (after the bounded wait) are told apart."""
    import torch.distributed as dist
    from desync_cases import CountingStore

    from hp_cp_torch.distributed.desync import CollectiveLog

    store = CountingStore(dist.PrefixStore("g/", dist.HashStore()))
    logs = [CollectiveLog(k, 6, store, read_wait_s=0.2) for k in range(5)]  # not rank 5
    for k in (1, 3, 4):
        logs[k].enter("halo_exchange", 0)
        logs[k].enter("all_gather", 0)
    where = logs[0].enter("all_gather_meta", 1)
    assert where == "all_gather_meta #1 (layer 1)"
    assert store.ops == 0
    assert list(logs[1].recent) == ["halo_exchange #1 (layer 0)", "all_gather #2 (layer 0)"]
    for k in (1, 2, 3, 4):
        logs[k].publish()
    assert logs[0].report(where) == (
        "rank 0 waits in all_gather_meta #1 (layer 1); ranks 1, 3-4 last entered "
        "all_gather #2 (layer 0); rank 2 entered no CP collective of this group yet; rank 5: "
        "unknown (no record: its CP group was never created, or the store cannot be reached)"
    )
    assert CollectiveLog(0, 2, None).report("x #1") == (
        "rank 0 waits in x #1; rank 1: unknown (no record: its CP group was never created, or "
        "the store cannot be reached)"
    )
