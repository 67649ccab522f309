"""``hp-cp bench --long``: one training step of the reference layers at cp = 8 for long S, one
process per rank, and what each rank holds (``bench-long.json``, a PNG plot).

What is measured, per S (doubling from ``--long-seqs``' first value): the three reference
layer kinds stacked (sliding window, CSA r = 4 with its indexer loss, HCA r = 128;
:data:`LONG_CONFIG`, tiny dims), load-balanced, ``regather_compressed_kv=True``, one step
(forward, a loss, backward) on 8 gloo ranks of this machine. Per rank: the peak *extra*
resident memory of the step (``VmHWM`` after the step minus ``VmRSS`` before it, the
high-water mark reset just before: the method of :mod:`hp_cp_torch.bench.memory`), the
step's wall seconds, the bytes it sent and received, and whether the loss is finite.

Then, in the same run:

* a line through the busiest rank's peak against the local rows S / cp (slope in bytes per
  local row, r^2): ``long_mem_fit_slope_per_local_row``, ``long_mem_fit_intercept_bytes``,
  ``long_mem_fit_r2``;
* weak scaling: the peak at (S, cp 8) over (S / 2, cp 4), the same local rows, at the largest
  measured S: ``long_weak_scaling_mem_ratio``;
* the option's cost and gain: the same step with ``regather_compressed_kv=False`` at
  ``--long-compare-seq``: ``long_step_time_regather_over_keep`` (wall seconds of the slower
  rank) and ``long_peak_mem_regather_over_keep``;
* parity: at ``--long-parity-seq`` the cp = 8 step's output, input gradient and every
  parameter's gradient (summed over ranks) against one process running the same layers
  through the CP path on a group of one (``long_parity_*_rel_err``);
* ``long_max_seq_cp8``: the longest S that ran (every rank finished, loss finite);
* with ``--long-hf``, the Hugging Face model's longest S at cp 4 and at cp 8 under one
  per-rank budget, by real training steps (``hf_max_seq_cp4``, ``hf_max_seq_cp8``,
  ``hf_max_seq_cp8_over_cp4``: :func:`hp_cp_torch.bench.memory.hf_cp_scaling_measures`).

A length whose predicted total (the line through the peaks so far, plus each process's
runtime, times 8 ranks) exceeds ``--long-max-total-bytes`` is not run (``long_skipped_seqs``):
the bench never exhausts a shared machine; nothing is reported for it.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import numpy as np

__all__ = ["LONG_CONFIG", "LONG_KINDS", "long_measures", "write_long_png"]

LONG_CONFIG: dict[str, Any] = dict(
    hidden_size=32,
    n_heads=2,
    head_dim=32,
    rope_head_dim=8,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    window_size=128,
    index_n_heads=1,
    index_head_dim=16,
    index_topk=16,
)
"""The reference layer's sizes for the long bench (tiny: 8 ranks of S = 1M on one machine);
window 128 as released."""

LONG_KINDS = (0, 4, 128)
"""The stacked layers: sliding window, CSA (indexer loss on, training mode), HCA."""


def _model(kinds: tuple[int, ...]) -> Any:
    import dataclasses

    import torch
    from torch import nn

    from hp_cp_torch.reference import DeepSeekV4Attention, DeepSeekV4AttentionConfig

    base = DeepSeekV4AttentionConfig(compress_ratio=4, **LONG_CONFIG)
    torch.manual_seed(0)
    layers = [DeepSeekV4Attention(dataclasses.replace(base, compress_ratio=r)) for r in kinds]
    return nn.Sequential(*layers).train()


def _inputs(seq: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(1)
    hidden = LONG_CONFIG["hidden_size"]
    return torch.randn(1, seq, hidden, generator=gen), torch.randn(1, seq, hidden, generator=gen)


def _step_worker(
    rank: int, world: int, seq: int, regather: bool, kinds: tuple[int, ...], parity: bool
) -> dict[str, Any]:
    """One training step on this rank's rows; with ``parity``, rank 0 also returns the full
    output, input gradient and parameter gradients (summed over ranks)."""
    import gc

    import torch
    import torch.distributed as dist

    from hp_cp_core import CPConfig, disable_cp, enable_cp
    from hp_cp_torch.bench.memory import reset_peak, status_bytes

    torch.set_num_threads(1)
    model = _model(kinds)
    config = CPConfig(
        layout="load_balanced", regather_compressed_kv=regather, single_rank_bypass=False
    )
    handle = enable_cp(model, None, config)
    x, g = _inputs(seq)
    xl = handle.shard(x, 1).clone().requires_grad_(True)
    gl = handle.shard(g, 1).clone()
    del x, g
    gc.collect()
    if not reset_peak():  # VmHWM := VmRSS
        return {"peak": None}
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    out = model(xl)
    loss = (out.float() * gl).sum()
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM") - before
    stats = handle.stats()
    res: dict[str, Any] = {
        "peak": peak,
        "rss_before": before,
        "seconds": seconds,
        "bytes_sent": stats["bytes_sent"],
        "bytes_recv": stats["bytes_recv"],
        "loss_finite": bool(torch.isfinite(loss).item()),
        "regather_views": stats.get("regather_saved_views", 0),
    }
    if parity:
        full = handle.unshard(out.detach(), 1)
        gx = handle.unshard(xl.grad, 1)
        grads = {}
        for name, p in model.named_parameters():
            t = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            dist.all_reduce(t)
            grads[name] = t
        if rank == 0:
            res.update(out=full, gx=gx, grads=grads)
    disable_cp(handle)
    return res


def _rel_err(got: Any, want: Any) -> float:
    got, want = got.double(), want.double()
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    return diff / scale if scale else diff


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """``(slope, intercept, r^2)`` of the least-squares line."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    slope, intercept = np.polyfit(x, y, 1)
    pred = slope * x + intercept
    ss_res, ss_tot = float(((y - pred) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return float(slope), float(intercept), (1.0 - ss_res / ss_tot) if ss_tot else 1.0


def long_measures(
    seqs: tuple[int, ...] = (65536, 131072, 262144, 524288, 1048576),
    cp: int = 8,
    parity_seq: int = 131072,
    compare_seq: int = 262144,
    max_total_bytes: int = 12 << 30,
    kinds: tuple[int, ...] = LONG_KINDS,
    log: Any = print,
) -> dict[str, Any]:
    """The ``long_*`` keys (see the module docstring)."""
    from hp_cp_torch.cli.launch import run_ranks

    res: dict[str, Any] = {
        "long_cp": cp,
        "long_kinds": list(kinds),
        **{f"long_config_{k}": v for k, v in LONG_CONFIG.items()},
    }
    peaks: dict[int, float] = {}
    skipped: list[int] = []
    rss: list[float] = []
    t_all = time.perf_counter()

    def run(seq: int, world: int, regather: bool, parity: bool = False) -> list[dict]:
        t0 = time.perf_counter()
        ranks = run_ranks(world, _step_worker, seq, regather, kinds, parity, timeout=7200)
        log(
            f"long: S={seq} cp={world} regather={regather}: "
            f"peak {max(r['peak'] for r in ranks) / 2**20:.0f} MiB (max rank), "
            f"step {max(r['seconds'] for r in ranks):.1f} s, job {time.perf_counter() - t0:.0f} s"
        )
        return ranks

    by_seq: dict[int, list[dict]] = {}
    for seq in seqs:
        if len(peaks) >= 2:
            s, b, _ = _fit([k / cp for k in peaks], list(peaks.values()))
            predicted = cp * (s * seq / cp + b + max(rss))
            if predicted > max_total_bytes:
                skipped.append(seq)
                log(f"long: S={seq} skipped, predicted {predicted / 2**30:.1f} GiB in all")
                continue
        ranks = run(seq, cp, True, parity=seq == parity_seq)
        if any(r["peak"] is None for r in ranks):
            return {"long_mem_note": "VmHWM cannot be reset here (/proc/self/clear_refs)"}
        by_seq[seq] = ranks
        peaks[seq] = float(max(r["peak"] for r in ranks))
        rss.append(float(max(r["rss_before"] for r in ranks)))
        key = f"s{seq}"
        res[f"long_peak_mem_bytes_{key}"] = [r["peak"] for r in ranks]
        res[f"long_step_seconds_{key}"] = max(r["seconds"] for r in ranks)
        res[f"long_bytes_sent_max_rank_{key}"] = max(r["bytes_sent"] for r in ranks)
        res[f"long_bytes_recv_max_rank_{key}"] = max(r["bytes_recv"] for r in ranks)
        res[f"long_loss_finite_{key}"] = all(r["loss_finite"] for r in ranks)
        res[f"long_regather_saved_views_{key}"] = sum(r["regather_views"] for r in ranks)
    res["long_peak_mem_bytes_by_seq"] = {str(s): p for s, p in peaks.items()}
    res["long_rss_before_step_bytes_max"] = max(rss) if rss else 0
    if skipped:
        res["long_skipped_seqs"] = skipped
    trained = [s for s in peaks if res[f"long_loss_finite_s{s}"]]
    res["long_max_seq_cp8" if cp == 8 else f"long_max_seq_cp{cp}"] = max(trained, default=0)
    if len(peaks) >= 2:
        slope, intercept, r2 = _fit([s / cp for s in peaks], list(peaks.values()))
        res["long_mem_fit_slope_per_local_row"] = slope
        res["long_mem_fit_intercept_bytes"] = intercept
        res["long_mem_fit_r2"] = r2
    if peaks:  # weak scaling at the largest S measured: the same local rows at cp / 2
        top = max(peaks)
        half = run(top // 2, cp // 2, True)
        res["long_weak_scaling_seq"] = top
        res[f"long_peak_mem_bytes_cp{cp // 2}_s{top // 2}"] = [r["peak"] for r in half]
        res["long_weak_scaling_mem_ratio"] = peaks[top] / max(r["peak"] for r in half)
    if compare_seq in by_seq:  # the option's cost: the same step keeping the slots
        keep = run(compare_seq, cp, False)
        on = by_seq[compare_seq]
        res["long_compare_seq"] = compare_seq
        res[f"long_step_seconds_keep_s{compare_seq}"] = max(r["seconds"] for r in keep)
        res[f"long_peak_mem_bytes_keep_s{compare_seq}"] = [r["peak"] for r in keep]
        res["long_step_time_regather_over_keep"] = max(r["seconds"] for r in on) / max(
            r["seconds"] for r in keep
        )
        res["long_peak_mem_regather_over_keep"] = peaks[compare_seq] / max(r["peak"] for r in keep)
    if parity_seq in by_seq:  # the cp = 8 step against one process
        got = next(r for r in by_seq[parity_seq] if "out" in r)
        one = run(parity_seq, 1, True, parity=True)[0]
        res["long_parity_seq"] = parity_seq
        res["long_parity_out_rel_err"] = _rel_err(got["out"], one["out"])
        res["long_parity_grad_x_rel_err"] = _rel_err(got["gx"], one["gx"])
        res["long_parity_grad_params_max_rel_err"] = max(
            _rel_err(got["grads"][n], one["grads"][n]) for n in one["grads"]
        )
        res["long_peak_mem_bytes_one_process"] = one["peak"]
        res["long_step_seconds_one_process"] = one["seconds"]
    res["long_time_total_s"] = time.perf_counter() - t_all
    return res


def _per_rank(res: dict[str, Any], key: str) -> list[float]:
    """``res[key]``, or the ``key_<rank>`` entries a written JSON flattened it into."""
    if key in res:
        return list(res[key])
    out, i = [], 0
    while f"{key}_{i}" in res:
        out.append(res[f"{key}_{i}"])
        i += 1
    return out


def write_long_png(res: dict[str, Any], path: str) -> str:
    """Per-rank peak memory against S (every rank's point, the busiest rank's fitted line);
    returns the renderer (``"matplotlib"``, or ``"none"`` without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no plot without matplotlib
        return "none"
    cp = int(res.get("long_cp", 8))
    seqs = sorted(int(s) for s in res.get("long_peak_mem_bytes_by_seq", {}))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in seqs:
        ranks = _per_rank(res, f"long_peak_mem_bytes_s{s}")
        ax.scatter([s] * len(ranks), [p / 2**20 for p in ranks], s=12, color="tab:blue")
    if "long_mem_fit_slope_per_local_row" in res and seqs:
        xs = np.linspace(0, max(seqs), 50)
        slope, b = res["long_mem_fit_slope_per_local_row"], res["long_mem_fit_intercept_bytes"]
        r2 = res["long_mem_fit_r2"]
        ax.plot(
            xs,
            (slope * xs / cp + b) / 2**20,
            color="tab:red",
            label=f"fit (busiest rank): {slope:.0f} B per local row + {b / 2**20:.0f} MiB, "
            f"r2 = {r2:.4f}",
        )
    top = res.get("long_weak_scaling_seq")
    if top:
        half = _per_rank(res, f"long_peak_mem_bytes_cp{cp // 2}_s{top // 2}")
        ax.scatter(
            [top // 2] * len(half),
            [p / 2**20 for p in half],
            s=14,
            marker="x",
            color="tab:green",
            label=f"cp {cp // 2} at S = {top // 2} (the same local rows as cp {cp} at {top})",
        )
    ax.set_xlabel("S (tokens)")
    ax.set_ylabel(f"peak extra resident MiB per rank (cp {cp})")
    ax.set_title("one training step, sliding + CSA + HCA reference layers, regather on")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def main_long(args: Any) -> int:
    """``hp-cp bench --long``: write the JSON and the PNG, print the headline keys."""
    from hp_cp_torch.bench.numbers import flatten_numbers

    seqs = [int(v) for v in args.long_seqs.split(",") if v]
    res: dict[str, Any] = {}
    if seqs:
        res.update(
            long_measures(
                tuple(seqs),
                cp=args.long_cp,
                parity_seq=args.long_parity_seq,
                compare_seq=args.long_compare_seq,
                max_total_bytes=int(args.long_max_total_bytes),
            )
        )
    if getattr(args, "long_hf", False):
        from hp_cp_torch.bench.memory import hf_cp_scaling_measures

        res.update(hf_cp_scaling_measures())
    if not args.no_long_paper:
        from hp_cp_torch.bench.paper import paper_measures

        res.update(paper_measures())
    out = os.path.abspath(args.long_out)
    if args.long_merge and os.path.exists(out):
        with open(out) as f:
            res = {**json.load(f), **res}
    png = args.png or os.path.join(os.path.dirname(out), "docs", "bench-long.png")
    for path in (out, png):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if "long_peak_mem_bytes_by_seq" in res:
        res["long_png_renderer"] = write_long_png(res, png)
    numbers, notes = flatten_numbers(res)
    for key, value in res.items():  # keep the per-S dict readable
        if isinstance(value, dict):
            numbers[key] = value
            notes.pop(key, None)
    with open(out, "w") as f:
        json.dump({**numbers, **notes}, f, indent=1, sort_keys=True)
    for key in (
        "long_max_seq_cp8",
        "long_mem_fit_slope_per_local_row",
        "long_mem_fit_r2",
        "long_weak_scaling_mem_ratio",
        "long_step_time_regather_over_keep",
        "long_peak_mem_regather_over_keep",
        "long_parity_out_rel_err",
        "long_parity_grad_params_max_rel_err",
        "long_skipped_seqs",
        "hf_max_seq_cp4",
        "hf_max_seq_cp8",
        "hf_max_seq_cp8_over_cp4",
    ):
        if key in res:
            value = res[key]
            print(f"{key:<44} {value if not isinstance(value, float) else f'{value:.4g}'}")
    print(f"wrote {out} and {png}")
    return 0 if all(math.isfinite(v) for v in numbers.values() if isinstance(v, float)) else 1
