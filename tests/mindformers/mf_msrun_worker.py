"""msrun worker: every rank runs every parity case of ``cases.parity_cases(world)`` on MindSpore
CPU and writes ``<outdir>/rank<r>.json`` after each case.

Per case, every rank builds the same reference cell and the same global inputs (seeded); the
first rank of the CP group computes the single-device output and gradients (once per job for
cases that differ only in layout, mesh form or collectives: ``REFERENCES``) and sends them to
the others; then every rank runs the cell under CP on its own rows (q / key RoPE'd at the
rows' global positions, ``handle.shard``) and compares: output rows, input gradients (this
rank's rows) and parameter gradients (summed over the CP ranks with AllReduce). Usage:
``msrun ... mf_msrun_worker.py OUTDIR [CASE-SUBSTRINGS]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

T0 = time.time()
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor, ops  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mf_cpu_threads import limit_cpu_threads  # noqa: E402

limit_cpu_threads()
from mindspore.communication import (  # noqa: E402
    GlobalComm,
    create_group,
    get_group_size,
    get_rank,
    init,
)

init()
T_INIT = time.time() - T0

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mf_reference as ref  # noqa: E402
from mf_cases import Case, parity_cases  # noqa: E402

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp  # noqa: E402
from hp_cp_mindformers import patch_mindformers_deepseek_v4_csa_forward  # noqa: E402
from hp_cp_mindformers.backend import Capabilities  # noqa: E402

WORLD_RANK, WORLD = get_rank(), get_group_size()
OUT = sys.argv[1]


class HPMesh:
    """A HyperParallel-style 1-D mesh: ``size()``, ``get_local_rank()``, ``get_group()``."""

    ndim = 1

    def __init__(self, group: str) -> None:
        self.group = group

    def size(self) -> int:
        return get_group_size(self.group)

    def get_local_rank(self) -> int:
        return get_rank(self.group)

    def get_group(self) -> str:
        return self.group


def rel(a: np.ndarray, b: np.ndarray) -> float:
    scale = float(np.abs(b).max()) if b.size else 0.0
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    return diff / max(scale, 1e-30)


def rope(t: np.ndarray, positions: np.ndarray) -> Tensor:
    """RoPE on the last 8 lanes at the given positions (what the parent layer does)."""
    table = ref.ReferenceRotaryEmbedding(8, 10000.0)
    freqs, _ = table(len(positions), position_ids=positions)
    x = Tensor(t)
    nope, pe = x[..., :-8], x[..., -8:]
    return ops.concat([nope, ref.apply_mla_rope(pe, freqs)], -1)


SUBGROUPS: dict[int, str] = {}
REFERENCES: dict[tuple, np.ndarray] = {}
"""The single-device results this rank computed, by what decides them (``reference_key``):
the cases of the two layouts (and the AllReduce form) share the cell, its weights and inputs,
so their leader runs the one-device cell once per job, not once per case."""


def reference_key(case: Case, make_cell: Callable[[Case], Any]) -> tuple:
    """What the single-device result of ``case`` depends on: the cell (its builder, r, the
    training mode) and the seeded global inputs (rows, batch, document ends); not the layout,
    the mesh form or the collectives, which only the CP run sees."""
    return (make_cell, case.r, case.train, case.seq, case.packed, case.ends)


def runs_here(case: Case) -> bool:
    """Whether this rank takes part in ``case`` (sub-group ``case.part`` only, if set)."""
    return case.part < 0 or WORLD_RANK // case.cp == case.part


def cp_group(case: Case) -> str:
    if not case.subgroup:
        return GlobalComm.WORLD_COMM_GROUP
    first = (WORLD_RANK // case.cp) * case.cp
    if first not in SUBGROUPS:
        name = f"hp_cp_{first}"
        create_group(name, list(range(first, first + case.cp)))
        SUBGROUPS[first] = name
    return SUBGROUPS[first]


def reference_cell(case: Case) -> Any:
    cfg = ref.ReferenceCSAConfig(dsa_indexer_loss_coeff=1.0 if case.train else 0.0, seed=7)
    cell = ref.CompressedSparseAttention(cfg, None, 1, compress_ratio=case.r)
    cell.set_train(case.train)
    return cell


def last_indexer_loss(cell: Any) -> float:
    return float(cell.last_indexer_loss.asnumpy())


def run_case(
    case: Case,
    make_cell: Callable[[Case], Any] = reference_cell,
    logged_loss: Callable[[Any], float] = last_indexer_loss,
) -> dict:
    """One parity case on this rank: ``make_cell(case)`` builds the cell (the same weights on
    every rank), ``logged_loss(cell)`` reads the indexer loss it logged after a forward."""
    t0 = time.time()
    cell = make_cell(case)
    params = cell.trainable_params()
    b = 1 if case.packed else 2
    s = case.seq
    rng = np.random.default_rng([case.r, s, b, int(case.train)])
    q_pre = rng.standard_normal((s, b, 4, 32)).astype(np.float32)
    k_pre = rng.standard_normal((s, b, 1, 32)).astype(np.float32)
    x = rng.standard_normal((s, b, 64)).astype(np.float32)
    qr = rng.standard_normal((s, b, 48)).astype(np.float32)
    cot = rng.standard_normal((s, b, 4, 32)).astype(np.float32)
    asl = Tensor(np.array(case.ends, np.int32)) if case.packed else None

    # single device: computed by the first rank of the CP group (once per job for the cases
    # sharing ``reference_key``), sent to the others after enable_cp (one AllReduce), so the
    # 2-core test machine does it once per group
    group = cp_group(case)
    leader = get_rank(group) == 0
    inputs_full = (rope(q_pre, np.arange(s)), rope(k_pre, np.arange(s)), Tensor(x), Tensor(qr))
    sizes = [int(np.prod(cot.shape)), *[int(np.prod(t.shape)) for t in inputs_full]]
    sizes += [int(np.prod(p.shape)) for p in params] + [1]
    ref_flat = np.zeros(sum(sizes), np.float32)
    key = reference_key(case, make_cell)
    if leader and key in REFERENCES:
        ref_flat = REFERENCES[key]
    elif leader:
        stash = []

        def loss_full(q, k, xx, qq):
            out = cell(q, k, xx, qq, asl)
            stash.append(out)
            return (out * Tensor(cot)).sum()

        grad_fn = ms.value_and_grad(loss_full, grad_position=(0, 1, 2, 3), weights=params)
        _, (g_in_ref, g_par_ref) = grad_fn(*inputs_full)
        parts = [stash.pop(), *g_in_ref, *g_par_ref]
        loss_ref = logged_loss(cell) if case.r == 4 and case.train else 0.0
        ref_flat = np.concatenate([p.asnumpy().reshape(-1) for p in parts] + [[loss_ref]])
        ref_flat = REFERENCES[key] = ref_flat.astype(np.float32)

    # under CP
    mesh = HPMesh(group) if case.mesh == "object" else group
    config = DeepSeekV4CPConfig(layout=case.layout, query_chunk=8)
    if case.mesh == "object":
        handle = patch_mindformers_deepseek_v4_csa_forward(cell, cp_mesh=mesh, config=config)
    else:
        handle = enable_cp(cell, mesh, config)
    if case.emulate:
        c = handle.group.caps
        handle.group.caps = Capabilities(c.device, False, c.reduce_scatter, c.p2p)
    rank = handle.cp_rank
    ref_all = handle.group._all_reduce(Tensor(ref_flat), "test").asnumpy()
    pieces = np.split(ref_all, np.cumsum(sizes)[:-1])
    out_ref = pieces[0].reshape(cot.shape)
    g_in_ref = [pc.reshape(t.shape) for pc, t in zip(pieces[1:5], inputs_full)]
    g_par_ref = [pc.reshape(p.shape) for pc, p in zip(pieces[5:-1], params)]
    loss_ref = float(pieces[-1][0])
    stash = []
    pos_local = handle.shard(np.arange(s), 0)
    q_loc = rope(handle.shard(q_pre, 0), pos_local)
    k_loc = rope(handle.shard(k_pre, 0), pos_local)
    x_loc, qr_loc = Tensor(handle.shard(x, 0)), Tensor(handle.shard(qr, 0))
    cot_loc = Tensor(handle.shard(cot, 0))

    def loss_cp(q, k, xx, qq):
        out = cell(q, k, xx, qq, asl)
        stash.append(out)
        return (out * cot_loc).sum()

    cp_grad = ms.value_and_grad(loss_cp, grad_position=(0, 1, 2, 3), weights=params)
    _, (g_in, g_par) = cp_grad(q_loc, k_loc, x_loc, qr_loc)
    out_t = stash.pop()
    out = out_t.asnumpy()
    loss_cp = None
    if case.r == 4 and case.train:  # the global token-weighted mean, logged on every rank
        loss_cp = logged_loss(cell)
    full_again = handle.unshard(out_t, 0).asnumpy()
    plan = next(iter(handle.cache._plans.values()))
    stats = handle.stats()

    res = {
        "name": case.name,
        "cp_rank": rank,
        "cp_size": handle.cp_size,
        "installed": "construct" in cell.__dict__,
        "out_err": rel(out, handle.shard(out_ref, 0)),
        "unshard_err": rel(full_again, out_ref),
        "grad_err": {},
        "param_err": {},
        "n_owned": plan.n_owned,
        "n_needed": plan.n_needed_slots,
        "window_halo": plan.window.n_halo,
        "collectives": stats["collectives"],
        "bytes_sent": stats["bytes_sent"],
        "bytes_recv": stats["bytes_recv"],
    }
    for name, got, want in zip(("query", "key", "x", "qr"), g_in, g_in_ref):
        res["grad_err"][name] = rel(got.asnumpy(), handle.shard(want, 0))
    # parameter gradients summed over the CP ranks (one AllReduce of all of them)
    flat = np.concatenate([g.asnumpy().reshape(-1) for g in g_par])
    total = handle.group._all_reduce(Tensor(flat), "test").asnumpy()
    at = 0
    for p, want in zip(params, g_par_ref):
        res["param_err"][p.name] = rel(total[at : at + want.size].reshape(want.shape), want)
        at += want.size
    if case.r == 4 and case.train:
        res["loss_err"] = abs(loss_cp - loss_ref) / max(abs(loss_ref), 1e-30)
        res["loss_ref"] = loss_ref
    disable_cp(handle)
    res["restored"] = "construct" not in cell.__dict__
    res["restored_err"] = rel(cell(*inputs_full, asl).asnumpy(), out_ref)
    ms.runtime.synchronize()
    res["seconds"] = round(time.time() - t0, 2)
    return res


def run_all(
    cases: list[Case],
    make_cell: Callable[[Case], Any] = reference_cell,
    logged_loss: Callable[[Any], float] = last_indexer_loss,
    extra: dict | None = None,
) -> None:
    """Run the ``cases`` this rank takes part in; write ``<outdir>/rank<r>.json`` after each
    (with ``extra`` added to the report)."""
    report = {"rank": WORLD_RANK, "world": WORLD, "t_import_init_s": round(T_INIT, 2), "cases": {}}
    report.update(extra or {})
    path = os.path.join(OUT, f"rank{WORLD_RANK}.json")
    only = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else None
    for case in cases:
        if (only and not any(o in case.name for o in only)) or not runs_here(case):
            continue
        try:
            report["cases"][case.name] = run_case(case, make_cell, logged_loss)
        except Exception as exc:  # noqa: BLE001 - reported per case to the pytest side
            report["cases"][case.name] = {
                "name": case.name,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)


def main() -> None:
    run_all(parity_cases(WORLD))


if __name__ == "__main__":
    main()
