"""GPU check of ``attention_kernel="triton"``: parity with the small-op kernel, then a
benchmark against the small-op and efficient kernels at Flash shapes.

Run on a CUDA machine from the repository root (no installs needed: torch, triton, numpy
and pluggy)::

    PYTHONPATH=hp_cp_core/src:hp_cp_torch/src python scripts/device_triton.py [OUT.json]

The JSON goes to the argument, else ``$HP_CP_DEVICE_JSON``, else ``$OUT/device-triton.json``,
else ``./device-triton.json``; a table is printed. ``--smoke`` runs tiny shapes on the CPU
under Triton's interpreter (sets ``TRITON_INTERPRET=1``), to check the script itself.

What it measures, per sequence length S (B = 1, H = 64, D = 512, K = 640, bf16, random
column lists without -1 into a pool of S + S // 4 rows):

* fwd and fwd + bwd time (CUDA events, median of the timed runs after one warm-up run);
* achieved TFLOP/s, counting ``4 B S H K D`` for the forward and 2.5 times that for the
  backward;
* peak memory of one fwd + bwd above the inputs (``torch.cuda.max_memory_allocated``);
* a dense bf16 ``torch.matmul`` (8192^3) in the same run, for the throughput target:
  Triton fwd + bwd >= 5x faster than the efficient kernel and >= 30% of dense matmul.

Variants that would not fit (small-op at S = 16384) or that start after ``DEADLINE_S`` are
skipped and listed with the reason; the default Triton kernel and the efficient kernel always
run. Meant to finish within 90 s on an H200 (46 s with four Triton variants in its second
run).
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

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from hp_cp_torch.kernels.efficient import sparse_attention_efficient  # noqa: E402
from hp_cp_torch.kernels.smallop import sparse_attention_smallop  # noqa: E402
from hp_cp_torch.kernels.triton_attention import sparse_attention_triton  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
START = time.perf_counter()
DEADLINE_S = 70.0  # past this, skip all but TARGETS (the whole run must stay under 90 s)
HEADS, DIM, TOPK = (64, 512, 640) if not SMOKE else (4, 32, 40)
SEQS = (4096, 16384) if not SMOKE else (32, 64)
TARGETS = ("triton", "efficient")  # always run: the targets compare these two
# tuning variants of the Triton kernel; the default first (forward BLOCK_K 64, dq fused
# into the dKV kernel, delta pass with 64 heads x 64 columns: the fastest of runs 2 and 3)
TRITON_VARIANTS: dict[str, dict[str, Any] | None] = {
    "triton": None,
    # one program per row sums both head blocks before its atomic add: half the atomics
    # (dq from the dq kernel's second pass instead of the fused one)
    "triton-all-heads": {"bwd": {"ALL_HEADS": True}},
    # the delta pass with the backward's own tiles (the default before run 3)
    "triton-delta-bwd-tiles": {"delta": {"BLOCK_H": 32, "BLOCK_K": 32}},
}


def out_path() -> Path:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if args:
        return Path(args[0])
    if os.environ.get("HP_CP_DEVICE_JSON"):
        return Path(os.environ["HP_CP_DEVICE_JSON"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "device-triton.json"
    return Path("device-triton.json")


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
    for v in TRITON_VARIANTS
    if v != "triton"
]
if SMOKE:
    PARITY = [(n, (b, min(s, 9), min(h, 20), min(d, 40), p, min(k, 45)), t, v)
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


def smallop_skip_reason(seq: int) -> str | None:
    """Small-op gathers fp32 ``[S, K, D]`` and keeps about three such tensors for backward."""
    need = 3 * seq * TOPK * DIM * 4
    if DEVICE == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if need > 0.4 * total:
            return f"needs about {need / 2**30:.0f} GiB (3 fp32 [S, K, D] tensors) > 40% of HBM"
    return None


def bench_one(kernel: str, fn, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    q, kv, idx, sink, grad = inputs
    seq = q.shape[1]
    scale = DIM**-0.5

    def forward():
        with torch.no_grad():
            fn(q, kv, idx, sink, scale)

    def step():
        out = fn(q, kv, idx, sink, scale)
        torch.autograd.grad(out, [q, kv, sink], grad)

    row: dict[str, Any] = {"S": seq, "kernel": kernel}
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync()
        row["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    fwd = timed(forward)
    both = timed(step)
    flops_fwd = 4 * seq * HEADS * TOPK * DIM
    row["fwd_ms"] = statistics.median(fwd) * 1e3
    row["fwd_bwd_ms"] = statistics.median(both) * 1e3
    row["runs"] = len(both)
    row["tflops_fwd"] = flops_fwd / statistics.median(fwd) / 1e12
    row["tflops_fwd_bwd"] = 3.5 * flops_fwd / statistics.median(both) / 1e12
    return row


def benchmark() -> list[dict[str, Any]]:
    triton = {
        name: lambda q, kv, i, s, sc, t=tuning: sparse_attention_triton(q, kv, i, s, sc, tuning=t)
        for name, tuning in TRITON_VARIANTS.items()
    }
    # what the targets need first, the tuning variants last (the time budget skips those)
    kernels: dict[str, Any] = {"triton": triton.pop("triton")}
    kernels.update(efficient=sparse_attention_efficient, smallop=sparse_attention_smallop)
    kernels.update(triton)
    rows = []
    for seq in SEQS:
        # one pool row per column (no -1), a pool of S + S / 4 rows (window KV + CSA slots)
        q, kv, idx, sink = make_case(
            1, seq, HEADS, DIM, seq + seq // 4, TOPK, torch.bfloat16, seed=seq, awkward=False
        )
        grad = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)
        inputs = (q.requires_grad_(True), kv.requires_grad_(True), idx, sink.requires_grad_(True))
        inputs = (*inputs, grad)
        for kernel, fn in kernels.items():
            reason = smallop_skip_reason(seq) if kernel == "smallop" else None
            if reason is None and kernel not in TARGETS and elapsed() > DEADLINE_S:
                reason = f"time budget: {elapsed():.0f} s used of {DEADLINE_S:.0f}"
            if reason is not None:
                rows.append({"S": seq, "kernel": kernel, "skipped": reason})
                print(f"[{elapsed():5.0f} s] bench S={seq:6d} {kernel:16s} skipped: {reason}")
                continue
            try:
                row = bench_one(kernel, fn, inputs)
            except Exception as exc:  # noqa: BLE001 - OOM or a compile failure: reported
                row = {"S": seq, "kernel": kernel, "skipped": f"{type(exc).__name__}: {exc}"[:500]}
                traceback.print_exc()
            finally:
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            got = row.get("fwd_bwd_ms", row.get("skipped"))
            print(f"[{elapsed():5.0f} s] bench S={seq:6d} {kernel:16s} fwd+bwd ms: {got}")
    return rows


def targets(rows: list[dict[str, Any]], dense: float, parity_rows: list[dict]) -> dict[str, Any]:
    """Speed-up over efficient and fraction of dense matmul, for the default Triton kernel
    and for the fastest variant whose parity passed."""
    failed = {p["variant"] for p in parity_rows if not p["ok"]}
    out: dict[str, Any] = {}
    for seq in SEQS:
        by = {r["kernel"]: r for r in rows if r["S"] == seq and "fwd_bwd_ms" in r}
        tri = [r for k, r in by.items() if k.startswith("triton") and k not in failed]
        if not tri:
            out[str(seq)] = {"error": "no Triton variant ran (with passing parity)"}
            continue
        best = min(tri, key=lambda r: r["fwd_bwd_ms"])
        res: dict[str, Any] = {"best_triton_variant": best["kernel"]}
        if "triton" in by and "efficient" in by:
            res["default_speedup_vs_efficient"] = (
                by["efficient"]["fwd_bwd_ms"] / by["triton"]["fwd_bwd_ms"]
            )
            res["default_fraction_of_dense_bf16"] = by["triton"]["tflops_fwd_bwd"] / dense
        if "efficient" in by:
            res["speedup_vs_efficient"] = by["efficient"]["fwd_bwd_ms"] / best["fwd_bwd_ms"]
            res["meets_5x_vs_efficient"] = res["speedup_vs_efficient"] >= 5
        res["fraction_of_dense_bf16"] = best["tflops_fwd_bwd"] / dense
        res["meets_30pct_of_dense"] = res["fraction_of_dense_bf16"] >= 0.3
        out[str(seq)] = res
    return out


def print_table(report: dict[str, Any]) -> None:
    print()
    dense = report["dense_bf16_tflops"]
    print(f"device: {report['device']}; dense bf16 matmul {dense:.0f} TFLOP/s")
    head = f"{'S':>6} {'kernel':16} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TF/s fwd':>9}"
    print(f"{head} {'TF/s f+b':>9} {'peak GiB':>9}")
    for r in report["bench"]:
        if "skipped" in r:
            print(f"{r['S']:>6} {r['kernel']:16} skipped: {r['skipped'][:90]}")
            continue
        peak = r.get("peak_mem_gib")
        print(
            f"{r['S']:>6} {r['kernel']:16} {r['fwd_ms']:9.2f} {r['fwd_bwd_ms']:11.2f} "
            f"{r['tflops_fwd']:9.1f} {r['tflops_fwd_bwd']:9.1f} "
            f"{'' if peak is None else f'{peak:9.2f}'}"
        )
    for seq, t in report["targets"].items():
        print(f"targets S={seq}: {t}")
    print(f"parity: {sum(p['ok'] for p in report['parity'])}/{len(report['parity'])} ok; "
          f"{report['seconds']:.0f} s")  # fmt: skip


def main() -> int:
    if not SMOKE and not torch.cuda.is_available():
        print("device_triton.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
        return 2
    import triton

    report: dict[str, Any] = {
        "device": "cpu (interpreter smoke run)" if SMOKE else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {"B": 1, "H": HEADS, "D": DIM, "K": TOPK, "S": list(SEQS), "dtype": "bf16"},
        "flops": "fwd 4*B*S*H*K*D, bwd 2.5x fwd",
    }
    report["parity"] = parity()
    report["dense_bf16_tflops"] = dense_matmul_tflops()
    report["bench"] = benchmark()
    report["targets"] = targets(report["bench"], report["dense_bf16_tflops"], report["parity"])
    report["seconds"] = elapsed()
    path = out_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"wrote {path}")
    return 0 if all(p["ok"] for p in report["parity"]) else 1


if __name__ == "__main__":
    sys.exit(main())
