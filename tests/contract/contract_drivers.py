"""One driver per backend for the contract suite: build a small layer of that backend, run it
under CP for cp 1..3 and on one device, and read the traffic counters.

A driver never imports its framework at module level, so this file loads (and the fake
backend's contract runs) where only ``hp_cp_core`` is installed.

Driver interface:

* ``cases``: the contract cases (:class:`ContractCase`) it runs.
* ``run()``: ``{case: [per-rank dict]}``; every per-rank dict has ``stats`` (``handle.stats()``
  right after one forward) and ``restored`` (the original forward is back after
  ``disable_cp``); the dict of CP rank 0 also has what ``check`` needs.
* ``check(case, per_rank)``: assert CP equals the single-device layer.
* ``counts(stats)``: ``(halo exchanges, all-gathers)`` of one forward, from the stats.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KNOWN_BACKENDS = ("fake", "torch", "mindformers")
FRAMEWORK = {"fake": None, "torch": "torch", "mindformers": "mindspore"}
ENV = "HP_CP_REQUIRE_BACKEND"


def required_backends() -> set[str]:
    return {b.strip() for b in os.environ.get(ENV, "").split(",") if b.strip()}


def backend_status(name: str) -> str | None:
    """``None`` when backend ``name`` is installed and loads, else why not."""
    framework = FRAMEWORK.get(name)
    if framework is not None and importlib.util.find_spec(framework) is None:
        return f"{framework} is not installed"
    from hp_cp_core.plugins import PluginHost

    host = PluginHost(autoload=True)
    status = host.statuses.get(name)
    if status is None:
        return f"no hp_cp entry point named {name!r} is installed"
    if not status.ok:
        return f"the {name!r} plugin does not load: {status.error}"
    return None


CP_SIZES = (1, 2, 3)
RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class ContractCase:
    cp: int
    r: int
    layout: str
    packed: bool

    @property
    def name(self) -> str:
        lay = "lb" if self.layout == "load_balanced" else "contig"
        return f"cp{self.cp}-r{self.r}-{lay}-{'packed' if self.packed else 'padded'}"


CASES = tuple(
    ContractCase(cp, r, layout, packed)
    for cp in CP_SIZES
    for r in RATIOS
    for layout, packed in (("contiguous", False), ("load_balanced", True))
)


# ------------------------------------------------------------------------------ fake


class FakeDriver:
    """The in-process numpy backend: ranks are threads (``hp_cp_fake``)."""

    name = "fake"
    cases = CASES

    @staticmethod
    def total(case: ContractCase) -> int:
        chunk = -(-260 // (2 * case.cp)) if case.r == 128 else 5  # L = 10 < W - 1 = 15
        return 2 * case.cp * chunk

    @staticmethod
    def cu(case: ContractCase) -> np.ndarray | None:
        if not case.packed:
            return None
        total, short = FakeDriver.total(case), max(case.r, 4) - 1
        # a document shorter than r, an empty one, one spanning ranks, two short ones
        return np.array([0, short, short, min(short + total // 2, total - 2), total - 2, total])

    @staticmethod
    def layer(case: ContractCase) -> Any:
        from hp_cp_fake import fake_backend as fb

        return fb.ToyAttention(compress_ratio=case.r, window_size=16, index_topk=3)

    @functools.cache  # noqa: B019 - one driver object per session
    def run(self) -> dict[ContractCase, list[dict]]:
        from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
        from hp_cp_core.plugins import PluginHost
        from hp_cp_fake import fake_backend as fb

        host = PluginHost()  # discovered through the installed entry points
        out = {}
        for case in self.cases:
            x = np.random.default_rng(case.cp * 100 + case.r).normal(size=(self.total(case), 6))
            world = fb.FakeWorld(case.cp)
            cu = self.cu(case)

            def rank_fn(rank: int, case=case, x=x, world=world, cu=cu) -> dict:
                layer = self.layer(case)
                handle = enable_cp(
                    layer,
                    fb.FakeMesh(world, rank),
                    DeepSeekV4CPConfig(layout=case.layout),
                    plugins=host,
                )
                try:
                    local = layer(handle.shard(x, 0), cu_seqlens=cu)
                    stats = handle.stats()
                    full = handle.unshard(local, 0)
                finally:
                    disable_cp(handle)
                return {"stats": stats, "restored": layer.cp_forward is None, "out": full}

            out[case] = world.run(rank_fn)
        return out

    def check(self, case: ContractCase, per_rank: list[dict]) -> None:
        from hp_cp_fake import fake_backend as fb

        x = np.random.default_rng(case.cp * 100 + case.r).normal(size=(self.total(case), 6))
        want = fb.single_device(self.layer(case), x, self.cu(case))
        for rank, res in enumerate(per_rank):
            np.testing.assert_allclose(
                res["out"], want, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}"
            )

    @staticmethod
    def counts(stats: dict) -> tuple[int, int]:
        calls = stats["calls"]
        return calls.get("exchange_rows", 0), calls.get("all_gather_rows", 0)


# ------------------------------------------------------------------------------ torch


TORCH_TESTS = Path(__file__).resolve().parent.parent / "torch"


def _torch_case(case: ContractCase) -> Any:
    from cases import Case, default_chunk

    chunk = default_chunk(case.cp, case.r, case.packed)
    return Case(case.cp, case.r, case.layout, case.packed, chunk, query_chunk=5, seed=11)


def torch_contract_job(rank: int, world: int, cases: tuple[ContractCase, ...]) -> dict:
    """On 3 gloo ranks: groups of 1, 2 and 3 ranks, each running its cases."""
    import faulthandler
    import traceback

    import torch.distributed as dist
    from cases import run_reference_layer_cp

    faulthandler.dump_traceback_later(230, exit=True)
    groups = {cp: dist.new_group(list(range(cp))) for cp in CP_SIZES if cp < world}
    out: dict[ContractCase, tuple[str, Any]] = {}
    for case in cases:
        if rank >= case.cp:
            continue
        try:
            res = run_reference_layer_cp(_torch_case(case), groups.get(case.cp))
            res["stats"] = res["stats_fwd"]
            out[case] = ("ok", res)
        except Exception:  # noqa: BLE001 - reported by the test of this case
            out[case] = ("error", f"rank {rank}:\n{traceback.format_exc()}")
            break  # peers may wait in this case's collectives: leave
    faulthandler.cancel_dump_traceback_later()
    return out


class TorchDriver:
    """The torch backend on real gloo process groups (spawned processes)."""

    name = "torch"
    cases = CASES

    def __init__(self) -> None:
        if str(TORCH_TESTS) not in sys.path:
            sys.path.insert(0, str(TORCH_TESTS))

    @functools.cache  # noqa: B019 - one driver object per session
    def run(self) -> dict[ContractCase, list[dict]] | BaseException:
        from dist_utils import run_ranks

        try:
            per_rank = run_ranks(max(CP_SIZES), torch_contract_job, self.cases, timeout=240)
        except BaseException as exc:  # noqa: BLE001 - reported by every case
            return exc
        out: dict[ContractCase, list[dict]] = {}
        for case in self.cases:
            got = [r[case] for r in per_rank if case in r]
            errors = [v for s, v in got if s != "ok"]
            out[case] = errors[0] if errors else [v for _, v in got]
        return out

    def check(self, case: ContractCase, per_rank: list[dict]) -> None:
        from cases import check_parity

        rank0 = next(r for r in per_rank if r["cp_rank"] == 0)
        check_parity(_torch_case(case), rank0)
        for r in per_rank:
            assert r["forward_installed"] == (case.cp > 1)

    @staticmethod
    def counts(stats: dict) -> tuple[int, int]:
        calls = stats["collectives"]
        return calls.get("halo_exchange", 0), calls.get("all_gather", 0)


# ------------------------------------------------------------------------------ mindformers


MF_TESTS = Path(__file__).resolve().parent.parent / "mindformers"
MF_WORKER = Path(__file__).resolve().parent / "mf_contract_worker.py"
MF_WORLD = 3
MF_TIMEOUT_S = 600


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MindformersDriver:
    """The mindformers backend's reference cell on MindSpore CPU ranks: ONE ``msrun`` job of 3
    workers (cp = 3 on the world group, cp = 2 on a sub-group of ranks 0-1, cp = 1 on rank 2;
    see ``mf_contract_worker.py``); each rank reports JSON per case."""

    name = "mindformers"
    cases = CASES

    def __init__(self) -> None:
        if str(MF_TESTS) not in sys.path:
            sys.path.insert(0, str(MF_TESTS))

    @functools.cache  # noqa: B019 - one driver object per session
    def run(self) -> dict[ContractCase, list[dict] | str] | BaseException:
        import json
        import signal
        import subprocess
        import tempfile

        from mf_cases import msrun_executable

        msrun = msrun_executable()
        if msrun is None:
            return RuntimeError("msrun not found (set HP_CP_MSRUN_BIN to the venv's bin dir)")
        out = tempfile.mkdtemp(prefix="hp_cp_contract_mf_")
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(msrun) + os.pathsep + env.get("PATH", "")  # runs `python`
        env.setdefault("GLOG_v", "3")
        spec = json.dumps([[c.cp, c.r, c.layout, c.packed] for c in self.cases])
        cmd = [
            msrun,
            f"--worker_num={MF_WORLD}",
            f"--local_worker_num={MF_WORLD}",
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
                rc: Any = proc.wait(timeout=MF_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        reports = []
        for r in range(MF_WORLD):
            path = os.path.join(out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    reports.append(json.load(fh)["cases"])
        where = f"(msrun rc={rc}, logs in {out})"
        results: dict[ContractCase, list[dict] | str] = {}
        for case in self.cases:
            got = [rep[case.name] for rep in reports if case.name in rep]
            errors = [g["error"] + "\n" + g.get("traceback", "") for g in got if "error" in g]
            if errors:
                results[case] = errors[0]
            elif len(got) != case.cp:
                results[case] = f"{len(got)} of {case.cp} ranks reported {case.name} {where}"
            else:
                results[case] = sorted(got, key=lambda g: g["cp_rank"])
        return results

    def check(self, case: ContractCase, per_rank: list[dict]) -> None:
        from mf_cases import OUT_TOL

        assert [r["cp_rank"] for r in per_rank] == list(range(case.cp))
        for r in per_rank:
            who = f"{case.name} rank {r['cp_rank']}"
            assert r["cp_size"] == case.cp, who
            assert r["installed"] == (case.cp > 1), f"{who}: installed={r['installed']}"
            assert r["out_err"] <= OUT_TOL, f"{who}: output rel err {r['out_err']:.3g}"
            assert r["unshard_err"] <= OUT_TOL, f"{who}: unshard rel err {r['unshard_err']:.3g}"

    @staticmethod
    def counts(stats: dict) -> tuple[int, int]:
        calls = stats["collectives"]
        return calls.get("halo_exchange", 0), calls.get("all_gather", 0)


DRIVERS = {"fake": FakeDriver, "torch": TorchDriver, "mindformers": MindformersDriver}
