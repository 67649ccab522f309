"""The MindFormers backend's contract driver: the reference cell on MindSpore CPU ranks.

ONE ``msrun`` job of 3 workers runs every case (cp = 3 on the world group, cp = 2 on a
sub-group of ranks 0-1, cp = 1 on rank 2; see ``mf_worker.py``); each rank compares its
result with the single-device cell and reports JSON per case. Forward only (the MindSpore
backward is tested by ``tests/mindformers``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hp_cp_core.testing.cases import ContractCase

MF_TESTS = Path(__file__).resolve().parents[2] / "mindformers"
MF_WORKER = Path(__file__).resolve().with_name("mf_worker.py")
WORLD = 3
TIMEOUT_S = 600


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MindformersDriver:
    name = "mindformers"
    framework = "mindspore"
    max_cp = WORLD
    rtol = 1e-5  # the msrun tests' bound (mf_cases.OUT_TOL)
    differentiable = False

    def run(self, cases: Sequence[ContractCase]) -> dict[str, Any]:
        return self._run(tuple(cases))

    @functools.cache  # noqa: B019 - one driver object per session
    def _run(self, cases: tuple[ContractCase, ...]) -> dict[str, Any]:
        if str(MF_TESTS) not in sys.path:
            sys.path.insert(0, str(MF_TESTS))
        from mf_cases import msrun_executable

        msrun = msrun_executable()
        if msrun is None:
            raise RuntimeError("msrun not found (set HP_CP_MSRUN_BIN to the venv's bin dir)")
        out = tempfile.mkdtemp(prefix="hp_cp_contract_mf_")
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(msrun) + os.pathsep + env.get("PATH", "")  # runs `python`
        env.setdefault("GLOG_v", "3")
        spec = json.dumps([dataclasses.asdict(c) for c in cases])
        cmd = [
            msrun,
            f"--worker_num={WORLD}",
            f"--local_worker_num={WORLD}",
            f"--master_port={_free_port()}",
            f"--log_dir={os.path.join(out, 'logs')}",
            "--join=True",
            str(MF_WORKER),
            out,
            spec,
        ]
        with open(os.path.join(out, "msrun.txt"), "w") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc: Any = proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        reports = []
        for r in range(WORLD):
            path = os.path.join(out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    reports.append(json.load(fh)["cases"])
        where = f"(msrun rc={rc}, logs in {out})"
        results: dict[str, Any] = {}
        for case in cases:
            got = [rep[case.name] for rep in reports if case.name in rep]
            failed = [g["failure"] for g in got if "failure" in g]
            if failed:
                results[case.name] = failed[0]
            elif len(got) != case.cp:
                results[case.name] = f"{len(got)} of {case.cp} ranks reported {case.name} {where}"
            else:
                results[case.name] = sorted((_report(g) for g in got), key=lambda g: g["cp_rank"])
        return results


def _report(got: dict) -> dict:
    if "error" in got:
        return got
    return {
        "cp_rank": got["cp_rank"],
        "stats_forward": got["stats"],
        "stats": got["stats"],
        "restored": got["restored"],
        "rel_err": {"out": got["out_err"], "unshard out": got["unshard_err"]},
    }
