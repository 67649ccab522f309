"""msrun worker of the mindformers contract driver (``mindformers_driver.MindformersDriver``).

Started on 3 MindSpore CPU ranks: cp = 3 cases on the world group (every rank), cp = 2 on the
communication sub-group of ranks 0 and 1, cp = 1 on rank 2 alone (a 1-rank mesh), so ranks 0-1
and rank 2 work side by side. Per case every rank of the CP group builds the reference cell
``mf_reference.CompressedSparseAttention`` (tests/mindformers) and the same seeded global inputs,
runs one forward under CP on its rows, records ``handle.stats()``, gathers the output with
``handle.unshard`` and compares it with the single-device cell (every rank: the 2-core machine
can afford it); then ``disable_cp`` and checks the cell is restored. Writes
``<outdir>/rank<r>.json`` after each case. Usage: ``msrun ... mf_worker.py OUTDIR CASES-JSON``
where CASES-JSON is a list of :class:`~hp_cp_core.testing.cases.ContractCase` fields.

Helpers (``init()``, RoPE, the mesh object, relative error) come from
``tests/mindformers/mf_msrun_worker.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

MF_TESTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "mindformers"
)
sys.path.insert(0, MF_TESTS)

import mf_msrun_worker as w  # noqa: E402  (sets the CPU context and calls init())
import mf_reference as ref  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor  # noqa: E402
from mindspore.communication import GlobalComm, create_group  # noqa: E402

from hp_cp_core import HpCpError, disable_cp, enable_cp  # noqa: E402
from hp_cp_core.testing.cases import ContractCase  # noqa: E402


class OneRankMesh:
    """A HyperParallel-style mesh of one rank (cp = 1 without a communication group)."""

    ndim = 1

    def size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0

    def get_group(self) -> str:
        return GlobalComm.WORLD_COMM_GROUP


SUB2 = "hp_cp_contract_2"


def mesh_for(cp: int):
    """This rank's mesh for a cp-sized case, or ``None`` when it sits the case out."""
    rank, world = w.WORLD_RANK, w.WORLD
    if cp == world:
        return GlobalComm.WORLD_COMM_GROUP
    if cp == 1:
        return OneRankMesh() if rank == world - 1 else None
    return SUB2 if rank < cp else None


def run_case(case: ContractCase) -> dict:
    t0 = time.time()
    cp, r = case.cp, case.r
    cfg = ref.ReferenceCSAConfig(seed=7 + case.seed, csa_window_size=case.window)
    cell = ref.CompressedSparseAttention(cfg, None, 1, compress_ratio=r)
    cell.set_train(False)
    s, packed = case.rows, case.packed
    b = 1 if packed else 2
    rng = np.random.default_rng([r, s, b])
    q_pre = rng.standard_normal((s, b, 4, 32)).astype(np.float32)
    k_pre = rng.standard_normal((s, b, 1, 32)).astype(np.float32)
    x = rng.standard_normal((s, b, 64)).astype(np.float32)
    qr = rng.standard_normal((s, b, 48)).astype(np.float32)
    asl = Tensor(np.array(case.cu_seqlens[1:], np.int32)) if packed else None
    inputs_full = (w.rope(q_pre, np.arange(s)), w.rope(k_pre, np.arange(s)), Tensor(x), Tensor(qr))
    want = cell(*inputs_full, asl).asnumpy()
    mine = case.cu_for_rank(_group_rank(cp))
    if case.bad_rank is not None and mine is not None:
        asl = Tensor(np.array(mine[1:], np.int32))

    handle = enable_cp(cell, mesh_for(cp), case.config(query_chunk=8))
    try:
        installed = "construct" in cell.__dict__
        pos = handle.shard(np.arange(s), 0)
        local = cell(
            w.rope(handle.shard(q_pre, 0), pos),
            w.rope(handle.shard(k_pre, 0), pos),
            Tensor(handle.shard(x, 0)),
            Tensor(handle.shard(qr, 0)),
            asl,
        )
        stats = handle.stats()
        out_err = w.rel(local.asnumpy(), handle.shard(want, 0))
        full_err = w.rel(handle.unshard(local, 0).asnumpy(), want)
        cp_rank, cp_size = handle.cp_rank, handle.cp_size
    finally:
        disable_cp(handle)
    restored = "construct" not in cell.__dict__
    restored_err = w.rel(cell(*inputs_full, asl).asnumpy(), want)
    return {
        "cp_rank": cp_rank,
        "cp_size": cp_size,
        "installed": installed,
        "out_err": out_err,
        "unshard_err": full_err,
        "stats": stats,
        "restored": restored and restored_err == 0.0,
        "restored_err": restored_err,
        "seconds": round(time.time() - t0, 2),
    }


def main() -> None:
    out_dir, cases = sys.argv[1], json.loads(sys.argv[2])
    report = {"rank": w.WORLD_RANK, "world": w.WORLD, "cases": {}}
    path = os.path.join(out_dir, f"rank{w.WORLD_RANK}.json")
    if w.WORLD > 2 and w.WORLD_RANK < 2:
        create_group(SUB2, [0, 1])
    cases = [ContractCase(**{**c, "cu_seqlens": _tuple(c["cu_seqlens"])}) for c in cases]
    for case in sorted(cases, key=lambda c: -c.cp):  # world group first
        if case.cp > w.WORLD or mesh_for(case.cp) is None:
            continue
        name = case.name
        try:
            report["cases"][name] = run_case(case)
        except Exception as exc:  # noqa: BLE001 - reported per case to the pytest side
            if case.bad_rank is not None and isinstance(exc, HpCpError):
                report["cases"][name] = {
                    "cp_rank": _group_rank(case.cp),
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                    "error_types": [c.__name__ for c in type(exc).__mro__],
                }
            else:
                report["cases"][name] = {
                    "failure": f"rank {w.WORLD_RANK}: {type(exc).__name__}: {exc}"[:2000]
                    + "\n"
                    + traceback.format_exc()[-4000:]
                }
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)


def _tuple(cu):
    return None if cu is None else tuple(cu)


def _group_rank(cp: int) -> int:
    return 0 if cp == 1 else w.WORLD_RANK


if __name__ == "__main__":
    main()
