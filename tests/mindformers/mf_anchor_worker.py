"""msrun worker of ``nox -s bench_mindformers``: hp_cp side by side with MindFormers' own CSA CP
(``CompressedSparseAttentionContextParallel``, the anchor) on the same real mindformers 2.1.0
cell, the same inputs and the same msrun world (cp = world size, the world group).

Per case (training mode, indexer KL loss coefficient 0.5, contiguous padded input with local
rows a multiple of r: the only input the anchor takes): rank 0 runs the real cell on one device
(output, input and parameter gradients); then, for each implementation on a fresh cell with the
same weights, every rank runs one warm-up and ``ITERS`` timed forward + backward steps on its
rows and reports its time, the bytes it received (same CPU collective model for both: an
all-gather receives ``(cp - 1) n``, its AllReduce backward ``2 (cp - 1) n``) and its largest
relative error against one device (output rows, input gradients, parameter gradients summed
over ranks; the indexer's parameters are also reported apart). Writes ``<outdir>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mf_real_env as env  # noqa: E402  (stubs, CPU stand-ins, the real classes)

if env.SKIP_REASON or env.IMPORT_ERROR:
    raise SystemExit(f"the real mindformers cell cannot run: {env.SKIP_REASON or env.IMPORT_ERROR}")

import mf_msrun_worker as w  # noqa: E402  (communication init, RoPE, rel)
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindformers.pynative.distributed import csa_context_parallel as anchor_module  # noqa: E402
from mindspore import Tensor, ops  # noqa: E402
from mindspore.communication import GlobalComm  # noqa: E402

from hp_cp_core import DeepSeekV4CPConfig, enable_cp  # noqa: E402

ITERS = int(os.environ.get("HP_CP_BENCH_ITERS", "3"))
LOSS_COEFF = 0.5
WORLD_GROUP = GlobalComm.WORLD_COMM_GROUP
CASES = [(0, 256, 2), (4, 256, 2), (128, 1024, 1)]  # (r, global rows, batch)


def all_reduce(t: Tensor) -> Tensor:
    return ops.AllReduce(ops.ReduceOp.SUM, group=WORLD_GROUP)(t)


def barrier() -> None:
    all_reduce(Tensor(np.zeros(1, np.float32))).asnumpy()


class CountingGather:
    """Wraps the anchor's only collective (``_ag_seq``, a CP all-gather) to count the bytes this
    rank receives, forward and backward, with the model hp_cp's MindSporeGroup counts with."""

    def __init__(self, inner, world: int) -> None:
        self.inner, self.world, self.bytes_recv = inner, world, 0

    def __call__(self, tensor: Tensor, group: str) -> Tensor:
        n = int(np.prod(tensor.shape)) * 4
        self.bytes_recv += (self.world - 1) * n + 2 * (self.world - 1) * n
        return self.inner(tensor, group)


def run_case(r: int, seq: int, b: int) -> dict:
    rank, world = w.WORLD_RANK, w.WORLD
    rows = seq // world
    lo, hi = rank * rows, (rank + 1) * rows
    rng = np.random.default_rng([r, seq, b])
    q_pre = rng.standard_normal((seq, b, 4, 32)).astype(np.float32)
    k_pre = rng.standard_normal((seq, b, 1, 32)).astype(np.float32)
    x = rng.standard_normal((seq, b, 64)).astype(np.float32)
    qr = rng.standard_normal((seq, b, 48)).astype(np.float32)
    cot = rng.standard_normal((seq, b, 4, 32)).astype(np.float32)
    pos = np.arange(seq)
    full = (w.rope(q_pre, pos), w.rope(k_pre, pos), Tensor(x), Tensor(qr))
    local = (
        w.rope(q_pre[lo:hi], pos[lo:hi]),
        w.rope(k_pre[lo:hi], pos[lo:hi]),
        Tensor(x[lo:hi]),
        Tensor(qr[lo:hi]),
    )

    def make():
        return env.real_cell(r, train=True, loss_coeff=LOSS_COEFF, seed=3)

    def step(cell, args, cotangent):
        params = cell.trainable_params()
        outs = []

        def f(*a):
            outs.append(cell(*a))
            return (outs[-1] * cotangent).sum()

        _, (gi, gp) = ms.value_and_grad(f, (0, 1, 2, 3), params)(*args)
        env.forget_logged_indexer_losses()
        return outs[-1], gi, gp

    # one device, on rank 0, sent to every rank with one AllReduce
    names = [p.name for p in make().trainable_params()]
    ref_cell = make()
    sizes = [cot.size, *[int(np.prod(t.shape)) for t in full]]
    sizes += [int(np.prod(p.shape)) for p in ref_cell.trainable_params()]
    flat = np.zeros(sum(sizes), np.float32)
    if rank == 0:
        out, gi, gp = step(ref_cell, full, Tensor(cot))
        flat = np.concatenate([t.asnumpy().reshape(-1) for t in (out, *gi, *gp)])
    parts = np.split(all_reduce(Tensor(flat)).asnumpy(), np.cumsum(sizes)[:-1])
    want_out = parts[0].reshape(cot.shape)[lo:hi]
    want_in = [p.reshape(t.shape)[lo:hi] for p, t in zip(parts[1:5], full)]
    want_par = parts[5:]

    res = {"r": r, "seq": seq, "batch": b, "local_rows": rows}
    for kind in ("ours", "anchor"):
        cell = make()
        counter = None
        if kind == "ours":
            handle = enable_cp(cell, WORLD_GROUP, DeepSeekV4CPConfig(layout="contiguous"))
        else:
            env.anchor_wrap(cell, env.FixedMesh(world, rank, WORLD_GROUP))
            counter = CountingGather(anchor_module._ag_seq, world)
            anchor_module._ag_seq = counter
        try:
            step(cell, local, Tensor(cot[lo:hi]))  # warm-up (plans, caches)
            before = handle.stats()["bytes_recv"] if kind == "ours" else counter.bytes_recv
            barrier()
            t0 = time.perf_counter()
            for _ in range(ITERS):
                out, gi, gp = step(cell, local, Tensor(cot[lo:hi]))
            ms.runtime.synchronize()
            seconds = (time.perf_counter() - t0) / ITERS
            after = handle.stats()["bytes_recv"] if kind == "ours" else counter.bytes_recv
        finally:
            if counter is not None:
                anchor_module._ag_seq = counter.inner
        summed = all_reduce(Tensor(np.concatenate([g.asnumpy().reshape(-1) for g in gp])))
        summed = np.split(summed.asnumpy(), np.cumsum([p.size for p in want_par])[:-1])
        errs = {"out": w.rel(out.asnumpy(), want_out)}
        for name, got, want in zip(("query", "key", "x", "qr"), gi, want_in):
            errs[f"d{name}"] = w.rel(got.asnumpy(), want)
        par = {n: w.rel(g, p) for n, g, p in zip(names, summed, want_par)}
        indexer = [e for n, e in par.items() if n.startswith("indexer.")]
        res[kind] = {
            "seconds": seconds,
            "bytes_recv": (after - before) // ITERS,
            "max_rel_err": max([*errs.values(), *par.values()]),
            "max_rel_err_indexer_params": max(indexer) if indexer else 0.0,
            "max_rel_err_other": max(
                [*errs.values(), *[e for n, e in par.items() if not n.startswith("indexer.")]]
            ),
        }
    return res


def main() -> None:
    out_dir = sys.argv[1]
    report = {"rank": w.WORLD_RANK, "world": w.WORLD, "cases": {}}
    for r, seq, b in CASES:
        name = f"cp{w.WORLD}-r{r}-S{seq}-b{b}"
        try:
            report["cases"][name] = run_case(r, seq, b)
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            report["cases"][name] = {
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        with open(os.path.join(out_dir, f"rank{w.WORLD_RANK}.json"), "w") as fh:
            json.dump(report, fh, indent=1)
    if w.WORLD_RANK == 0:
        report["anchor_refuses"] = env.anchor_refusals()
        with open(os.path.join(out_dir, "rank0.json"), "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
