"""Start one msrun job (once per pytest session and worker) and read its per-rank JSON reports;
used by the msrun test modules (pytest side only)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile

import pytest
from mf_cases import GRAD_TOL, OUT_TOL, Case, msrun_executable

_JOBS: dict[tuple, dict] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_msrun(worker: str, world: int, timeout_s: int, *args: str) -> dict:
    """Run ``worker OUTDIR *args`` on ``world`` msrun ranks (cached per session); returns
    ``{"rc", "reports": {rank: report}, "dir"}``. The job runs in its scratch directory
    (mindformers writes ``./output/log``)."""
    key = (worker, world, args)
    if key in _JOBS:
        return _JOBS[key]
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
        worker,
        out,
        *args,
    ]
    with open(os.path.join(out, "msrun.txt"), "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=out
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    _JOBS[key] = {"rc": rc, "reports": _read_reports(out, world), "dir": out}
    return _JOBS[key]


def _read_reports(folder: str, world: int) -> dict:
    reports = {}
    for r in range(world):
        path = os.path.join(folder, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as fh:
                reports[r] = json.load(fh)
    return reports


REAL_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mf_real_msrun_worker.py")
REAL_WORLD = 4


def run_real_job() -> dict:
    """The ONE msrun job of 4 ranks of the real mindformers 2.1.0 code (cached per session):
    the real cell's cases (``mf_real_msrun_worker.py``), then the whole model's
    (``mf_model_msrun_worker.py``, reports in ``job["model"]``, same keys as a job's)."""
    job = run_msrun(REAL_WORKER, REAL_WORLD, 3000, "--model-cases")
    if "model" not in job:
        model_dir = os.path.join(job["dir"], "model")
        job["model"] = {
            "rc": job["rc"],
            "reports": _read_reports(model_dir, REAL_WORLD),
            "dir": model_dir,
        }
    return job


def case_reports(job: dict, case: Case, ranks: list[int]) -> list[dict]:
    """The reports of ``case`` from the world ranks ``ranks``; fails on a missing one or an
    error (with the rank's traceback)."""
    where = f"(msrun rc={job['rc']}, logs in {job['dir']})"
    missing = [r for r in ranks if r not in job["reports"]]
    assert not missing, f"ranks {missing} wrote no report {where}"
    per_rank = []
    for r in ranks:
        got = job["reports"][r]["cases"].get(case.name)
        assert got is not None, f"rank {r} did not reach {case.name} {where}"
        assert "error" not in got, f"rank {r}: {got['error']}\n{got.get('traceback', '')}"
        per_rank.append(got)
    return per_rank


def assert_parity(case: Case, per_rank: list[dict]) -> None:
    """Every rank of ``case`` matched the single-device cell: output rows within ``OUT_TOL``,
    input gradients (its rows) and parameter gradients (summed over the CP ranks) within
    ``GRAD_TOL``, the logged indexer loss (r = 4, training), the forward installed and
    restored, one halo exchange and one all-gather each way."""
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
        if case.train and case.r == 4:
            assert res["loss_err"] <= OUT_TOL, f"{who}: indexer loss rel err {res['loss_err']}"
    # ranks that own no slot / see none still took part (no hang) and matched
    if case.cp == 4 and case.r == 128 and case.layout == "contiguous":
        assert per_rank[0]["n_owned"] == 0 and per_rank[0]["n_needed"] == 0
