"""GPU check of ``attention_kernel="triton"``: parity with the small-op kernel, then every
Triton variant (forward layout x pool-gradient path) timed at V4-Flash shapes, against a
dense bf16 matmul measured in the same run.

Run on a CUDA machine from the repository root (no installs needed: torch, triton, numpy
and pluggy)::

    PYTHONPATH=hp_cp_core/src:hp_cp_torch/src python scripts/device_triton.py [OUT.json]

The JSON goes to the argument, else ``$HP_CP_DEVICE_JSON``, else ``$OUT/triton2.json``,
else ``./triton2.json`` (keep it as ``bench/device/triton2.json``); a table is printed.
``--dry-run`` (or ``--smoke``) runs tiny shapes on the CPU under Triton's interpreter (sets
``TRITON_INTERPRET=1``), to check the script itself; its numbers mean nothing.

What it measures, per sequence length S (B = 1, H = 64, D = 512, K = 640, bf16, random
column lists without -1 into a pool of S + S // 4 rows), per variant:

* ``fwd_ms``, ``bwd_ms`` (the backward alone, on a kept graph), ``fwd_bwd_ms`` (CUDA
  events, median of the timed runs after one warm-up run);
* ``fwd_tflops``, ``bwd_tflops``, ``fwd_bwd_tflops``, counting ``4 B S H K D`` for the
  forward and 2.5 times that for the backward, and ``fwd_over_dense_matmul``;
* ``bitwise_reproducible``: two backward runs give the same bits (``torch.equal``);
* ``peak_mem_gib``: peak memory of one fwd + bwd above the inputs;
* for the atomics-free backward, ``index_build_ms``: the inversion of the picks alone
  (already inside ``bwd_ms``).

Then ``deterministic_mode``: the default backward under
``torch.use_deterministic_algorithms(True)`` (must run) and the atomics one (must raise).
Variants past ``DEADLINE_S`` are skipped and listed with the reason; the default always
runs. Meant to finish well within 10 minutes on an H200, Triton compiles included.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SMOKE = "--smoke" in sys.argv or "--dry-run" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from hp_cp_core import HpCpError  # noqa: E402
from hp_cp_torch.kernels.pool_index import build_inverted_index  # noqa: E402
from hp_cp_torch.kernels.smallop import sparse_attention_smallop  # noqa: E402
from hp_cp_torch.kernels.triton_attention import sparse_attention_triton  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
START = time.perf_counter()
DEADLINE_S = 300.0  # past this, skip all but the default (the run must stay under 10 min)
HEADS, DIM, TOPK = (64, 512, 640) if not SMOKE else (2, 32, 12)
SEQS = (4096, 16384) if not SMOKE else (8, 16)
TODAY_FWD_BWD_TFLOPS = 101.0  # bench/device/device-triton-h200.json, S = 4096, 0.2.0 kernel
OLD_FWD = {"LAYOUT": "head_blocks"}
ATOMIC_BWD = {"POOL_GRAD": "atomic"}
# the default first (heads-as-M forward, atomics-free backward), then each half swapped
# for the 0.2.0 one, then the 0.2.0 kernel, then tuning tries of the new paths
TRITON_VARIANTS: dict[str, dict[str, Any] | None] = {
    "triton": None,
    "triton-atomic-bwd": {"bwd": ATOMIC_BWD},
    "triton-old-fwd": {"fwd": OLD_FWD},
    "triton-0.2.0": {"fwd": OLD_FWD, "bwd": ATOMIC_BWD},
    # one program per row sums both head blocks: half the parts written and read
    "triton-owned-all-heads": {"bwd": {"ALL_HEADS": True}},
    # half the parts memory per chunk (more chunks, more launches)
    "triton-owned-parts-2g": {"bwd": {"PARTS_MIB": 2048}},
}
PARITY_VARIANTS = ("triton-atomic-bwd", "triton-old-fwd")  # with the default: every path


def out_path() -> Path:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if args:
        return Path(args[0])
    if os.environ.get("HP_CP_DEVICE_JSON"):
        return Path(os.environ["HP_CP_DEVICE_JSON"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "triton2.json"
    return Path("triton2.json")


def elapsed() -> float:
    return time.perf_counter() - START


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ inputs


def make_case(
    batch: int,
    seq: int,
    heads: int,
    dim: int,
    pool: int,
    k: int,
    dtype: torch.dtype,
    seed: int,
    awkward: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Random q, pool, column lists and sink, made on the device. ``awkward``: 20% ``-1``
    columns, an all ``-1`` row and duplicates (parity); else every column is a pool row."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g, device=DEVICE).to(dtype)
    kv = torch.randn(batch, pool, dim, generator=g, device=DEVICE).to(dtype)
    idx = torch.randint(0, pool, (batch, seq, k), generator=g, device=DEVICE)
    if awkward:
        idx = torch.where(torch.rand(batch, seq, k, generator=g, device=DEVICE) < 0.2, -1, idx)
        if seq > 2 and k > 2:
            idx[:, 2] = -1
            idx[:, 1, 1] = idx[:, 1, 0] = 5 % pool
    sink = torch.randn(heads, generator=g, device=DEVICE)
    return q, kv, idx, sink


def fwd_bwd(fn, q, kv, idx, sink, scale, grad):
    """Output and gradients of q, kv, sink for the cotangent ``grad``."""
    q = q.detach().clone().requires_grad_(True)
    kv = kv.detach().clone().requires_grad_(True)
    sink = sink.detach().clone().requires_grad_(True)
    out = fn(q, kv, idx, sink, scale)
    dq, dkv, dsink = torch.autograd.grad(out, [q, kv, sink], grad)
    return out, dq, dkv, dsink


# ------------------------------------------------------------------------------ parity

PARITY = [
    # name, (batch, seq, heads, dim, pool, k), dtype
    ("fp32 small, K not a power of 2", (2, 33, 3, 40, 50, 37), torch.float32),
    ("fp32 H=128 D=512 (two head blocks)", (1, 8, 128, 512, 300, 100), torch.float32),
    ("bf16 small", (2, 33, 3, 40, 50, 37), torch.bfloat16),
    # P a multiple of 16 like the benchmark's pool: Triton reuses this compile there
    ("bf16 Flash shape, S=64", (1, 64, HEADS, DIM, 1280, TOPK), torch.bfloat16),
    ("bf16 K=8192", (1, 4, 16, 128, 9000, 8192), torch.bfloat16),
]
PARITY = [(*p, "triton") for p in PARITY] + [
    (f"bf16 Flash shape, S=64, {v}", (1, 64, HEADS, DIM, 1280, TOPK), torch.bfloat16, v)
    for v in PARITY_VARIANTS
]
if SMOKE:
    PARITY = [(n, (b, min(s, 5), min(h, 4), min(d, 32), min(p, 64), min(k, 20)), t, v)
              for n, (b, s, h, d, p, k), t, v in PARITY]  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def parity() -> list[dict[str, Any]]:
    rows = []
    for name, shape, dtype, variant in PARITY:
        row: dict[str, Any] = {"name": name, "shape_B_S_H_D_P_K": list(shape), "dtype": str(dtype)}
        row["variant"] = variant
        try:
            q, kv, idx, sink = make_case(*shape, dtype=dtype, seed=len(rows))
            grad = torch.randn(q.shape, device=DEVICE).to(dtype)
            scale = shape[3] ** -0.5
            tuning = TRITON_VARIANTS[variant]
            triton = lambda *a, t=tuning: sparse_attention_triton(*a, tuning=t)  # noqa: E731
            got = fwd_bwd(triton, q, kv, idx, sink, scale, grad)
            again = fwd_bwd(triton, q, kv, idx, sink, scale, grad)
            row["bitwise_reproducible"] = all(torch.equal(a, b) for a, b in zip(got, again))
            # the reference: small-op in fp32 on the same (rounded) inputs
            ref = fwd_bwd(
                sparse_attention_smallop, q.float(), kv.float(), idx, sink, scale, grad.float()
            )
            names = ("out", "dq", "dkv", "dsink")
            row["rel_err"] = {n: rel(a, b) for n, a, b in zip(names, got, ref)}
            if dtype == torch.float32:
                tol = dict(zip(names, (1e-5, 1e-4, 1e-4, 1e-4)))
            else:  # no worse than small-op run in bf16 itself (2x), or 2% of the largest entry
                low = fwd_bwd(sparse_attention_smallop, q, kv, idx, sink, scale, grad)
                row["rel_err_smallop_bf16"] = {n: rel(a, b) for n, a, b in zip(names, low, ref)}
                tol = {n: max(2 * row["rel_err_smallop_bf16"][n], 2e-2) for n in names}
            row["tol"] = tol
            row["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
            row["ok"] = row["finite"] and all(row["rel_err"][n] <= tol[n] for n in names)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            row["ok"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        rows.append(row)
        verdict = "ok" if row["ok"] else "FAIL " + row.get("error", "")
        print(f"[{elapsed():5.0f} s] parity {name:38s} {verdict} {row.get('rel_err', '')}")
    return rows


# ------------------------------------------------------------------------------ benchmark


def timed(fn, min_s: float = 1.0, max_runs: int = 10) -> list[float]:
    """Seconds of each run of ``fn`` after one warm-up run (at least 1, until ``min_s``)."""
    fn()
    sync()
    if SMOKE:  # the dry run checks the script, not the speed: one timed run
        min_s, max_runs = 0.0, 1
    times: list[float] = []
    while len(times) < max_runs and (not times or sum(times) < min_s):
        if DEVICE == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def dense_matmul_tflops() -> float:
    n = 8192 if not SMOKE else 256
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    t = statistics.median(timed(lambda: a @ b, min_s=0.5, max_runs=50))
    return 2 * n**3 / t / 1e12


def grad_leaves(q, kv, sink):
    return [t.detach().clone().requires_grad_(True) for t in (q, kv, sink)]


def bench_one(kernel: str, tuning: dict[str, Any] | None, inputs) -> dict[str, Any]:
    q, kv, idx, sink, grad = inputs
    seq = q.shape[1]
    scale = DIM**-0.5

    def fn(*a):
        return sparse_attention_triton(*a, tuning=tuning)

    leaves = grad_leaves(q, kv, sink)

    def forward():
        with torch.no_grad():
            fn(q, kv, idx, sink, scale)

    def step():
        out = fn(leaves[0], leaves[1], idx, leaves[2], scale)
        return torch.autograd.grad(out, leaves, grad)

    row: dict[str, Any] = {"S": seq, "kernel": kernel, "tuning": tuning}
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync()
        row["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    first, second = step(), step()
    row["bitwise_reproducible"] = all(torch.equal(a, b) for a, b in zip(first, second))
    del first, second
    fwd = statistics.median(timed(forward))
    both = statistics.median(timed(step))
    out = fn(leaves[0], leaves[1], idx, leaves[2], scale)
    bwd = statistics.median(
        timed(lambda o=out: torch.autograd.grad(o, leaves, grad, retain_graph=True))
    )
    del out
    flops_fwd = 4 * seq * HEADS * TOPK * DIM
    row.update(fwd_ms=fwd * 1e3, bwd_ms=bwd * 1e3, fwd_bwd_ms=both * 1e3)
    row["fwd_tflops"] = flops_fwd / fwd / 1e12
    row["bwd_tflops"] = 2.5 * flops_fwd / bwd / 1e12
    row["fwd_bwd_tflops"] = 3.5 * flops_fwd / both / 1e12
    if (tuning or {}).get("bwd", {}).get("POOL_GRAD", "owned") == "owned":
        flat = idx.reshape(seq, TOPK)  # B = 1: every column inverted (no plan bands here)
        pool_rows = kv.shape[1]
        t = timed(lambda: build_inverted_index(flat, pool_rows, trim=False))
        row["index_build_ms"] = statistics.median(t) * 1e3
    return row


def benchmark(dense: float) -> list[dict[str, Any]]:
    rows = []
    for seq in SEQS:
        # one pool row per column (no -1), a pool of S + S / 4 rows (window KV + CSA slots)
        q, kv, idx, sink = make_case(
            1, seq, HEADS, DIM, seq + seq // 4, TOPK, torch.bfloat16, seed=seq, awkward=False
        )
        grad = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)
        inputs = (q, kv, idx, sink, grad)
        for kernel, tuning in TRITON_VARIANTS.items():
            if kernel != "triton" and elapsed() > DEADLINE_S and not SMOKE:
                reason = f"time budget: {elapsed():.0f} s used of {DEADLINE_S:.0f}"
                rows.append({"S": seq, "kernel": kernel, "tuning": tuning, "skipped": reason})
                print(f"[{elapsed():5.0f} s] bench S={seq:6d} {kernel:24s} skipped: {reason}")
                continue
            try:
                row = bench_one(kernel, tuning, inputs)
                row["fwd_over_dense_matmul"] = row["fwd_tflops"] / dense
                row["fwd_bwd_over_dense_matmul"] = row["fwd_bwd_tflops"] / dense
            except Exception as exc:  # noqa: BLE001 - OOM or a compile failure: reported
                row = {"S": seq, "kernel": kernel, "tuning": tuning}
                row["skipped"] = f"{type(exc).__name__}: {exc}"[:500]
                traceback.print_exc()
            finally:
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            got = row.get("fwd_bwd_ms", row.get("skipped"))
            print(f"[{elapsed():5.0f} s] bench S={seq:6d} {kernel:24s} fwd+bwd ms: {got}")
    return rows


def deterministic_mode() -> dict[str, Any]:
    """The default backward under ``torch.use_deterministic_algorithms(True)`` (must run,
    twice the same bits) and the atomics one (must raise HpCpError)."""
    seq = SEQS[0]
    q, kv, idx, sink = make_case(
        1, seq, HEADS, DIM, seq + seq // 4, TOPK, torch.bfloat16, seed=7, awkward=False
    )
    grad = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)
    res: dict[str, Any] = {"S": seq}
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [
            fwd_bwd(sparse_attention_triton, q, kv, idx, sink, DIM**-0.5, grad) for _ in range(2)
        ]
        res["default_runs"] = True
        res["default_bitwise_reproducible"] = all(torch.equal(a, b) for a, b in zip(*runs))
    except Exception as exc:  # noqa: BLE001 - reported
        res["default_runs"] = False
        res["default_error"] = f"{type(exc).__name__}: {exc}"[:500]
    try:
        atomic = lambda *a: sparse_attention_triton(*a, tuning={"bwd": ATOMIC_BWD})  # noqa: E731
        fwd_bwd(atomic, q, kv, idx, sink, DIM**-0.5, grad)
        res["atomic_refused"] = False
    except HpCpError:
        res["atomic_refused"] = True
    finally:
        torch.use_deterministic_algorithms(before)
    res["ok"] = res["default_runs"] and res.get("default_bitwise_reproducible") is True
    res["ok"] = res["ok"] and res["atomic_refused"]
    print(f"[{elapsed():5.0f} s] deterministic mode: {res}")
    return res


def targets(rows: list[dict[str, Any]], dense: float, parity_rows: list[dict]) -> dict[str, Any]:
    """The issue's targets for the default kernel and for the fastest variant whose paths
    passed parity: forward >= 40% of dense bf16 matmul, backward >= 140 TFLOP/s, forward +
    backward >= 2x today's 101 TFLOP/s."""
    failed = {p["variant"] for p in parity_rows if not p["ok"]}

    def passed(kernel: str) -> bool:  # a variant is made of paths the parity cases cover
        tuning = TRITON_VARIANTS[kernel] or {}
        paths = {"triton"}
        paths |= {"triton-old-fwd"} if tuning.get("fwd", {}).get("LAYOUT") else set()
        paths |= {"triton-atomic-bwd"} if tuning.get("bwd", {}).get("POOL_GRAD") else set()
        return not paths & failed

    out: dict[str, Any] = {}
    for seq in SEQS:
        by = {r["kernel"]: r for r in rows if r["S"] == seq and "fwd_bwd_ms" in r}
        ok = {k: r for k, r in by.items() if passed(k)}
        res: dict[str, Any] = {}
        for label, pick in (
            ("default", ok.get("triton")),
            ("best", min(ok.values(), key=lambda r: r["fwd_bwd_ms"]) if ok else None),
        ):
            if pick is None:
                res[label] = {"error": "did not run (or its parity failed)"}
                continue
            res[label] = {
                "kernel": pick["kernel"],
                "fwd_over_dense_matmul": pick["fwd_over_dense_matmul"],
                "meets_fwd_40pct_of_dense": pick["fwd_over_dense_matmul"] >= 0.4,
                "bwd_tflops": pick["bwd_tflops"],
                "meets_bwd_140_tflops": pick["bwd_tflops"] >= 140,
                "fwd_bwd_tflops": pick["fwd_bwd_tflops"],
                "meets_fwd_bwd_2x_today": pick["fwd_bwd_tflops"] >= 2 * TODAY_FWD_BWD_TFLOPS,
                "bitwise_reproducible": pick["bitwise_reproducible"],
            }
        if "triton" in by and "triton-0.2.0" in by:
            res["default_speedup_vs_0.2.0"] = (
                by["triton-0.2.0"]["fwd_bwd_ms"] / by["triton"]["fwd_bwd_ms"]
            )
        out[str(seq)] = res
    return out


def print_table(report: dict[str, Any]) -> None:
    print()
    dense = report["dense_bf16_tflops"]
    print(f"device: {report['device']}; dense bf16 matmul {dense:.0f} TFLOP/s")
    head = f"{'S':>6} {'kernel':24} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'fwd/mm':>7}"
    print(f"{head} {'TF bwd':>7} {'TF f+b':>7} {'bits':>5} {'peak GiB':>9}")
    for r in report["bench"]:
        if "skipped" in r:
            print(f"{r['S']:>6} {r['kernel']:24} skipped: {r['skipped'][:90]}")
            continue
        peak = r.get("peak_mem_gib")
        print(
            f"{r['S']:>6} {r['kernel']:24} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} "
            f"{r['fwd_bwd_ms']:8.2f} {r['fwd_over_dense_matmul']:7.1%} {r['bwd_tflops']:7.1f} "
            f"{r['fwd_bwd_tflops']:7.1f} {str(r['bitwise_reproducible'])[0]:>5} "
            f"{'' if peak is None else f'{peak:9.2f}'}"
        )
    for seq, t in report["targets"].items():
        print(f"targets S={seq}: {t}")
    print(f"parity: {sum(p['ok'] for p in report['parity'])}/{len(report['parity'])} ok; "
          f"deterministic mode ok: {report['deterministic_mode']['ok']}; "
          f"{report['seconds']:.0f} s")  # fmt: skip


def main() -> int:
    if not SMOKE and not torch.cuda.is_available():
        print("device_triton.py needs a CUDA GPU (or --dry-run for a CPU check of the script)")
        return 2
    import triton

    report: dict[str, Any] = {
        "device": "cpu (interpreter smoke run)" if SMOKE else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {"B": 1, "H": HEADS, "D": DIM, "K": TOPK, "S": list(SEQS), "dtype": "bf16"},
        "flops": "fwd 4*B*S*H*K*D, bwd 2.5x fwd",
        "variants": TRITON_VARIANTS,
    }
    if SMOKE:
        report["note"] = "dry run: CPU interpreter, tiny shapes; the numbers mean nothing"
    report["parity"] = parity()
    report["dense_bf16_tflops"] = dense_matmul_tflops()
    report["bench"] = benchmark(report["dense_bf16_tflops"])
    report["deterministic_mode"] = deterministic_mode()
    report["targets"] = targets(report["bench"], report["dense_bf16_tflops"], report["parity"])
    report["seconds"] = elapsed()
    path = out_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"wrote {path}")
    ok = all(p["ok"] for p in report["parity"]) and report["deterministic_mode"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
