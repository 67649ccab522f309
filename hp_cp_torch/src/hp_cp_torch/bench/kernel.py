"""The attention kernel against the machine: useful FLOP/s over ``torch.matmul`` FLOP/s.

``attn_flops_over_matmul_{r4,r128,r4_gathered}`` (default kernel) and
``attn_flops_over_matmul_<kernel>_<case>``: the FLOP/s one CSA / HCA attention forward +
backward achieves, counting only useful work, over the FLOP/s of a plain fp32
``torch.matmul`` measured in the same process with the same threads right before and right
after each of that kernel's runs (the highest), per wall second. The ``_cpu`` keys give the
same ratio per CPU second of the process (all threads; steadier when other jobs share the
machine, but they charge a kernel for its threads' idle spinning).

``attn_flops_over_matmul_<case>_<picks>`` (and ``_cpu``): the banded kernel with each way of
reading picks that lie in a block's slot band
(:data:`hp_cp_torch.kernels.banded.PICK_READS`: ``weights``, the default, ``log_weights``,
``mask``); the unsuffixed keys are the default's. Only ``r4`` reads picks as a band, so at
``r4_gathered`` and ``r128`` the variants run the same code: their spread is the machine's.
Every variant (kernel, or banded kernel and picks) of a case runs once per round, round after
round, and keeps its best round, so a machine that slows down mid-run slows every variant.

Useful work is counted from the columns that are really attended (not from padding):
``4 * B * H * D * sum_t K_t`` forward (``q . k`` and ``p . v``, two flops per multiply-add)
and 2.5x that backward, where ``K_t`` is query t's window keys plus its valid compressed
columns. The inputs are those of a real plan: the 1024 queries of the last rank of a
contiguous layout, so every query has a full window of W = 128 keys and, at r = 4, picks
``topk = 512`` distinct slots (at random) out of the ones it sees: ``K_t = 128 + 512`` for
every query, i.e. exactly ``4 * B * S * H * K * D`` with ``K = 640``. The cases:

* ``r4``: cp = 3 (S = 3072): each query sees 512 .. 767 slots, so a block's picks lie in a
  band under twice the top-k (the early part of a sequence);
* ``r4_gathered``: cp = 16 (S = 16384): each query sees 3840 .. 4095 slots, so the picks are
  gathered (any long context);
* ``r128``: cp = 3, every visible slot is attended (16 .. 23 per query).

The call is :func:`hp_cp_torch.attention.run_sparse_attention`, column planning included,
with gradients for q, the window KV, the slots and the sink.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["CASES", "KERNEL_SHAPES", "attention_case", "kernel_measures", "matmul_flops"]

KERNEL_SHAPES = {"batch": 1, "seq": 1024, "heads": 16, "dim": 512, "window": 128, "topk": 512}
"""Shapes of the measure (the issue's: B = 1, S = 1024, H = 16, D = 512, W = 128, top-k 512)."""

CASES = {"r4": (4, 3), "r4_gathered": (4, 16), "r128": (128, 3)}
"""Case name: (compress ratio, cp); the queries are the last rank's of a contiguous layout
over ``cp * S`` rows."""


def _clock(cpu: bool) -> float:
    return time.process_time() if cpu else time.perf_counter()


def matmul_flops(n: int = 1024, repeat: int = 5, cpu: bool = False) -> float:
    """Best-of-``repeat`` FLOP/s of an fp32 ``[n, n] @ [n, n]`` ``torch.matmul`` (``cpu``: per
    CPU second of this process, all threads, instead of per wall second)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.matmul(a, b)  # warm up
    best = float("inf")
    for _ in range(repeat):
        t0 = _clock(cpu)
        torch.matmul(a, b)
        best = min(best, _clock(cpu) - t0)
    return 2.0 * n**3 / best


def attention_case(
    ratio: int, shapes: dict[str, int] = KERNEL_SHAPES, cp: int = 3
) -> dict[str, Any]:
    """Inputs of one attention call (the last of ``cp`` contiguous ranks; see the module
    docstring) and its useful FLOPs."""
    import torch

    from hp_cp_core import LayerSpec, build_rank_plan

    b, s, h, d = shapes["batch"], shapes["seq"], shapes["heads"], shapes["dim"]
    spec = LayerSpec(compress_ratio=ratio, window_size=shapes["window"], has_indexer=ratio == 4)
    plan = build_rank_plan(
        rank=cp - 1,
        cp_size=cp,
        spec=spec,
        layout_kind="contiguous",
        total_rows=cp * s,
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, h, d, generator=g)
    ori = torch.randn(b, plan.window.ext_rows.size, d, generator=g)
    cmp = torch.randn(b, plan.n_needed_slots, d, generator=g)
    selected = None
    valid = plan.cmp_count.astype(np.int64)
    if ratio == 4:
        k = shapes["topk"]
        if int(plan.cmp_count.min()) < k:
            raise ValueError(f"every query must see >= {k} slots for the r = 4 case")
        # k distinct visible slots per query, in random order (the indexer's picks)
        keys = torch.rand(b, s, plan.n_needed_slots, generator=g)
        cols = torch.arange(plan.n_needed_slots)
        start = torch.as_tensor(plan.cmp_start)[:, None]
        seen = (cols >= start) & (cols < start + torch.as_tensor(plan.cmp_count)[:, None])
        selected = keys.masked_fill(~seen, -1.0).topk(k, dim=-1).indices
        valid = np.full(s, k, dtype=np.int64)
    sink = torch.randn(h, generator=g)
    columns = plan.window_len.astype(np.int64) + valid
    flops_fwd = 4.0 * b * h * d * float(columns.sum())
    return {
        "plan": plan,
        "tensors": (q, ori, cmp, sink),
        "selected": selected,
        "useful_flops": 3.5 * flops_fwd,
        "mean_columns": float(columns.mean()),
    }


def attention_seconds(
    kernel: str, case: dict[str, Any], repeat: int, cpu: bool = False, picks: str = "weights"
) -> float:
    """Best-of-``repeat`` seconds (``cpu``: CPU seconds of this process) of one forward +
    backward through ``run_sparse_attention`` (``picks``: the banded kernel's
    ``banded_picks``)."""
    import torch

    from hp_cp_torch.attention import run_sparse_attention

    leaves = [t.detach().clone().requires_grad_(True) for t in case["tensors"]]
    q, ori, cmp, sink = leaves
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    chunk = 256 if kernel == "smallop" else 1024  # small-op gathers [chunk, K, D] at once
    best = float("inf")
    for _ in range(repeat):
        t0 = _clock(cpu)
        out = run_sparse_attention(
            q,
            ori,
            cmp,
            case["plan"],
            case["selected"],
            sink,
            q.shape[-1] ** -0.5,
            kernel=kernel,
            query_chunk=chunk,
            banded_picks=picks,
        )
        torch.autograd.backward(out, grad)
        best = min(best, _clock(cpu) - t0)
        for t in leaves:
            t.grad = None
        del out
    return best


def kernel_measures(
    kernels: tuple[str, ...],
    threads: int = 2,
    repeat: int = 2,
    picks: tuple[str, ...] | None = None,
    shapes: dict[str, int] = KERNEL_SHAPES,
    cases: dict[str, tuple[int, int]] = CASES,
) -> dict[str, Any]:
    """``attn_flops_over_matmul_*`` keys (and the FLOP/s behind them) for ``kernels``; the
    unsuffixed ``attn_flops_over_matmul_<case>`` are the default kernel's (always run), the
    ``attn_flops_over_matmul_<case>_<picks>`` the banded kernel's with each of ``picks``
    (default: every :data:`~hp_cp_torch.kernels.banded.PICK_READS` when ``banded`` runs)."""
    import torch

    from hp_cp_core import CPConfig
    from hp_cp_torch.kernels.banded import PICK_READS

    default = CPConfig().attention_kernel
    kernels = (default, *[k for k in kernels if k != default])
    if picks is None:
        picks = PICK_READS if "banded" in kernels else ()
    shipped = PICK_READS[0]
    picks = (shipped, *[p for p in picks if p != shipped]) if picks else ()
    # (kernel, picks): the banded kernel once per way of reading picks
    variants = [(k, p) for k in kernels for p in (picks if k == "banded" and picks else (shipped,))]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        res: dict[str, Any] = {"attn_kernel_threads": threads}
        peaks = []
        for name, (ratio, cp) in cases.items():
            case = attention_case(ratio, shapes, cp=cp)
            res[f"attn_mean_columns_{name}"] = case["mean_columns"]
            for kernel, how in variants:
                attention_seconds(kernel, case, 1, picks=how)  # warm up
            for cpu, suffix in ((False, ""), (True, "_cpu")):
                secs = dict.fromkeys(variants, float("inf"))
                peak = dict.fromkeys(variants, 0.0)
                for _ in range(repeat):  # round after round, every variant once
                    for v in variants:
                        # the matmul rate right before and after (the highest counts)
                        rate_before = matmul_flops(cpu=cpu)
                        secs[v] = min(secs[v], attention_seconds(v[0], case, 1, cpu, v[1]))
                        peak[v] = max(peak[v], rate_before, matmul_flops(cpu=cpu))
                for (kernel, how), t in secs.items():
                    ratio_key = case["useful_flops"] / t / peak[(kernel, how)]
                    peaks.append(peak[(kernel, how)])
                    if kernel == "banded" and how in picks:
                        res[f"attn_seconds_{name}_{how}{suffix}"] = t
                        res[f"attn_flops_over_matmul_{name}_{how}{suffix}"] = ratio_key
                    if how != shipped:
                        continue
                    res[f"attn_seconds_{kernel}_{name}{suffix}"] = t
                    res[f"attn_matmul_gflops_{kernel}_{name}{suffix}"] = peak[(kernel, how)] / 1e9
                    res[f"attn_flops_over_matmul_{kernel}_{name}{suffix}"] = ratio_key
            for suffix in ("", "_cpu"):
                default_key = f"attn_flops_over_matmul_{default}_{name}{suffix}"
                res[f"attn_flops_over_matmul_{name}{suffix}"] = res[default_key]
        res["matmul_gflops_spread"] = max(peaks) / min(peaks)  # drift of the machine
        res["attn_default_kernel"] = default
        if picks:
            res["attn_banded_default_picks"] = shipped
        return res
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    """``python -m hp_cp_torch.bench.kernel``: only the kernel measures of ``hp-cp bench``,
    printed as JSON; ``--merge bench.json`` also writes their numbers into that file and their
    strings into ``bench.notes.json`` (the other keys kept)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m hp_cp_torch.bench.kernel")
    parser.add_argument("--kernels", default="banded", help="kernels (the default kernel first)")
    parser.add_argument("--picks", default=None, help="banded picks reads (default: all)")
    parser.add_argument("--repeat", type=int, default=2, help="timed rounds per clock")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--merge", default=None, help="a bench.json to update with the numbers")
    args = parser.parse_args(argv)
    picks = None if args.picks is None else tuple(p for p in args.picks.split(",") if p)
    kernels = tuple(k for k in args.kernels.split(",") if k)
    res = kernel_measures(kernels, threads=args.threads, repeat=args.repeat, picks=picks)
    print(json.dumps(res, indent=1, sort_keys=True))
    if args.merge:  # numbers into the JSON, the strings into its .notes.json (as hp-cp bench)
        from hp_cp_torch.bench.numbers import merge_numbers

        merge_numbers(args.merge, res)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
