"""CP on real MindSpore processes: cp = 2 and 4 started with ``msrun`` on CPU.

One msrun job per world size runs every case of ``mf_cases.parity_cases`` (start-up costs
10-30 s, so cases are grouped); each case is then checked here from the ranks' JSON reports:
output rows within 1e-5 relative of the single-device cell, input gradients (the rank's rows)
and parameter gradients (summed over the CP ranks) within 1e-4, the forward installed and
restored, and the traffic counters.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile

import pytest
from mf_cases import GRAD_TOL, OUT_TOL, Case, msrun_executable, parity_cases
from mf_require import mindspore_or_skip

mindspore_or_skip()

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mf_msrun_worker.py")
WORLDS = (2, 4)
TIMEOUT_S = {2: 900, 4: 1500}
_JOBS: dict[int, dict] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world: int) -> dict:
    """Run (once per session) the msrun job of ``world`` ranks; per-rank reports by rank."""
    if world in _JOBS:
        return _JOBS[world]
    msrun = msrun_executable()
    if msrun is None:
        pytest.fail("msrun not found (set HP_CP_MSRUN_BIN to the venv's bin dir)", pytrace=False)
    out = tempfile.mkdtemp(prefix=f"hp_cp_msrun{world}_")
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(msrun) + os.pathsep + env.get("PATH", "")  # msrun runs `python`
    env.setdefault("GLOG_v", "3")
    cmd = [
        msrun,
        f"--worker_num={world}",
        f"--local_worker_num={world}",
        f"--master_port={_free_port()}",
        f"--log_dir={os.path.join(out, 'logs')}",
        "--join=True",
        WORKER,
        out,
    ]
    with open(os.path.join(out, "msrun.txt"), "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=TIMEOUT_S[world])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    reports = {}
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as fh:
                reports[r] = json.load(fh)
    _JOBS[world] = {"rc": rc, "reports": reports, "dir": out}
    return _JOBS[world]


def _case_reports(world: int, case: Case) -> list[dict]:
    job = run_job(world)
    where = f"(msrun rc={job['rc']}, logs in {job['dir']})"
    assert len(job["reports"]) == world, f"only ranks {sorted(job['reports'])} reported {where}"
    per_rank = []
    for r in range(world):
        got = job["reports"][r]["cases"].get(case.name)
        assert got is not None, f"rank {r} did not reach {case.name} {where}"
        assert "error" not in got, f"rank {r}: {got['error']}\n{got.get('traceback', '')}"
        per_rank.append(got)
    return per_rank


PARAMS = [pytest.param(w, c, id=c.name) for w in WORLDS for c in parity_cases(w)]


@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_cp_matches_single_device(world: int, case: Case) -> None:
    per_rank = _case_reports(world, case)
    for res in per_rank:
        who = f"{case.name} rank {res['cp_rank']}"
        assert res["cp_size"] == case.cp
        assert res["installed"], f"{who}: the CP construct was not installed"
        assert res["out_err"] <= OUT_TOL, f"{who}: output rel err {res['out_err']:.3g}"
        assert res["unshard_err"] <= OUT_TOL, f"{who}: unshard rel err {res['unshard_err']:.3g}"
        for name, err in res["grad_err"].items():
            assert err <= GRAD_TOL, f"{who}: d{name} rel err {err:.3g}"
        assert res["param_err"], f"{who}: no parameter gradient compared"
        for name, err in res["param_err"].items():
            assert err <= GRAD_TOL, f"{who}: d{name} (summed over ranks) rel err {err:.3g}"
        assert res["restored"] and res["restored_err"] == 0.0, f"{who}: disable_cp did not restore"
        coll = res["collectives"]
        assert coll.get("halo_exchange") == 1 and coll.get("halo_exchange_bwd") == 1, coll
        if case.r:  # main + indexer slots in one all-gather (+ one for handle.unshard)
            assert coll.get("all_gather") == 2 and coll.get("all_gather_bwd") == 1, coll
        if case.train:
            assert res["loss_err"] <= OUT_TOL, f"{who}: indexer loss rel err {res['loss_err']}"
    # ranks that own no slot / see none still took part (no hang) and matched
    if case.cp == 4 and case.r == 128 and case.layout == "contiguous":
        assert per_rank[0]["n_owned"] == 0 and per_rank[0]["n_needed"] == 0


def test_grid_covers_the_issue() -> None:
    cases = [c for w in WORLDS for c in parity_cases(w)]
    for cp in WORLDS:
        grid = {(c.r, c.layout, c.packed) for c in cases if c.cp == cp and not c.subgroup}
        assert len(grid) == 12
    assert any(c.train for c in cases) and any(c.subgroup for c in cases)
    assert any(c.emulate for c in cases) and any(c.mesh == "object" for c in cases)
    # L < W - 1 (window halo from two ranks back) and runs shorter than r
    assert any(c.cp == 4 and c.r == 4 and c.seq // c.cp < 7 for c in cases)
    assert any(c.r == 128 and c.seq // c.cp < 128 for c in cases)
