"""``hp-cp bench``: traffic, balance, plan time, memory and step time of CP, in one run.

Two kinds of measure, kept apart:

* **exact, machine-independent** (from the plan and byte counts): bytes each rank receives
  against its own lower bound and against two peers' strategies, per-rank attention +
  indexer work, and the activation bytes the attention kernels keep for backward. These use
  DeepSeek V4-Flash attention shapes (:data:`FLASH`) at S = 131072, cp = 8 unless stated.
* **timed on this machine** (ratios within one run): plan-build seconds at S = 1M (best
  of 3), peak memory of one attention call, the step time (forward + backward) of a
  scaled-down reference CSA layer through the CP path at cp = 2 over cp = 1
  (:mod:`hp_cp_torch.bench.scaling`), the attention kernel's useful FLOP/s over
  ``torch.matmul``'s (:mod:`hp_cp_torch.bench.kernel`) and a Hugging Face model's
  training-step memory at cp = 4 over one device (:mod:`hp_cp_torch.bench.memory`); each
  module's docstring says exactly what it measures.

Writes a flat JSON object of numbers (``--out``, default ``./bench.json``; per-rank lists
become ``key_<rank>``; the strings that name a setup go to ``bench.notes.json``) and a PNG
bar chart of the headline ratios (``--png``, default next to the JSON; matplotlib when
importable, else a small built-in renderer), and
prints a table. ``python -m hp_cp_torch.bench --help``.

Traffic (the ``comm_*``, ``mindformers_*`` and ``ulysses_*`` keys) is counted in
:mod:`hp_cp_torch.bench.traffic`: see Note [Communication lower bound] and Note [Peer
strategies] there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import struct
import sys
import time
import zlib
from dataclasses import asdict
from typing import Any

import numpy as np

from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_torch.bench.numbers import flatten_numbers
from hp_cp_torch.bench.scaling import STEP_VARIANTS
from hp_cp_torch.bench.traffic import (
    FLASH,
    Shapes,
    comm_per_rank,
    dsa_traffic_measures,
    traffic_measures,
)

__all__ = ["FLASH", "Shapes", "comm_per_rank", "main", "work_per_rank"]


RATIOS = (0, 4, 128)


def layer_spec(ratio: int, shapes: Shapes = FLASH) -> LayerSpec:
    return LayerSpec(compress_ratio=ratio, window_size=shapes.window, has_indexer=ratio == 4)


def _plans(seq: int, cp: int, ratio: int, layout: str, shapes: Shapes) -> list[Any]:
    spec = layer_spec(ratio, shapes)
    return [
        build_rank_plan(rank=k, cp_size=cp, spec=spec, layout_kind=layout, total_rows=seq)
        for k in range(cp)
    ]


# ----------------------------------------------------------------------------- work


def work_per_rank(
    seq: int,
    cp: int,
    ratio: int,
    layout: str,
    shapes: Shapes = FLASH,
    query_chunk: int = 1024,
) -> dict[str, np.ndarray]:
    """Attention + indexer multiply-adds per rank.

    ``plan``: per local query, ``window_len * D * H * 2`` (scores and values) plus, for
    r = 128, ``visible * D * H * 2``; for r = 4, ``min(topk, visible) * D * H * 2`` and the
    indexer's ``visible * Di * index_heads``. ``impl``: what the kernels in
    :mod:`hp_cp_torch.attention` compute with ``query_chunk`` queries per chunk: W window
    columns and ``topk`` pick columns per query (``-1`` columns included), HCA columns up to
    the chunk's widest query, indexer scores over the chunk's slot range.
    """
    d, hh = shapes.head_dim, shapes.n_heads
    plans = _plans(seq, cp, ratio, layout, shapes)
    att, idx_work, impl = [], [], []
    for plan in plans:
        wl = plan.window_len.astype(np.float64)
        vis = plan.cmp_count.astype(np.float64)
        a = wl.sum() * d * hh * 2
        i = 0.0
        n = plan.n_local
        im = n * shapes.window * d * hh * 2.0
        if ratio == 128:
            a += vis.sum() * d * hh * 2
        elif ratio == 4:
            a += np.minimum(vis, shapes.topk).sum() * d * hh * 2
            i = vis.sum() * shapes.index_dim * shapes.index_heads
            im += n * shapes.topk * d * hh * 2.0
        if ratio:
            stop = plan.cmp_start + plan.cmp_count
            for lo in range(0, n, query_chunk):
                hi = min(lo + query_chunk, n)
                if ratio == 128:
                    im += (hi - lo) * float(plan.cmp_count[lo:hi].max()) * d * hh * 2
                else:
                    s0, s1 = int(plan.cmp_start[lo:hi].min()), int(stop[lo:hi].max())
                    im += (hi - lo) * max(s1 - s0, 0) * shapes.index_dim * shapes.index_heads
        att.append(a)
        idx_work.append(i)
        impl.append(im)
    att_a, idx_a = np.asarray(att), np.asarray(idx_work)
    return {"attention": att_a, "indexer": idx_a, "plan": att_a + idx_a, "impl": np.asarray(impl)}


def _max_over_mean(v: np.ndarray) -> float:
    return float(v.max() / v.mean()) if v.size and v.mean() > 0 else 1.0


# ----------------------------------------------------------------------------- plan build


def _random_cu_seqlens(tokens: int, docs: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=docs - 1, replace=False))
    return np.concatenate([[0], cuts, [tokens]]).astype(np.int64)


def plan_build_seconds(
    tokens: int, cp: int, docs: int, layout: str, repeat: int = 3, ratio: int = 4
) -> dict[str, list[float]]:
    """Best-of-``repeat`` ``build_rank_plan`` seconds of each rank (packed, ``docs`` random
    documents, r = 4 with indexer: the most index arrays), wall and CPU. The repeats go
    round the ranks, so a burst of load from other jobs does not hit every try of one rank."""
    spec = LayerSpec(compress_ratio=ratio, window_size=128, has_indexer=ratio == 4)
    cu = _random_cu_seqlens(tokens, docs, 0)
    kw = dict(cp_size=cp, spec=spec, layout_kind=layout, total_rows=tokens, cu_seqlens=cu)
    build_rank_plan(rank=0, **kw)  # warm-up
    wall, cpu = [math.inf] * cp, [math.inf] * cp
    for _ in range(repeat):
        for rank in range(cp):
            t0, c0 = time.perf_counter(), time.process_time()
            build_rank_plan(rank=rank, **kw)
            wall[rank] = min(wall[rank], time.perf_counter() - t0)
            cpu[rank] = min(cpu[rank], time.process_time() - c0)
    return {"wall": wall, "cpu": cpu}


# ----------------------------------------------------------------------------- saved bytes


def _attention_inputs(local_rows: int, heads: int, cp: int, device: str) -> tuple[Any, ...]:
    """``(q, ori_ext, cmp_kv, plan, selected, sink)`` of one CSA attention call: the last of
    ``cp`` ranks (the largest compressed pool), contiguous layout, Flash head_dim 512, window
    128 + top-k 512 columns, bf16 q and KV."""
    import torch

    plan = build_rank_plan(
        rank=cp - 1,
        cp_size=cp,
        spec=layer_spec(4),
        layout_kind="contiguous",
        total_rows=local_rows * cp,
    )
    d, bf16 = FLASH.head_dim, torch.bfloat16
    gen = None if device == "meta" else torch.Generator().manual_seed(0)

    def leaf(*shape: int, dtype: Any = bf16) -> Any:
        if device == "meta":
            return torch.empty(*shape, device="meta", dtype=dtype).requires_grad_(True)
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(True)

    q = leaf(1, plan.n_local, heads, d)
    ori = leaf(1, plan.window.ext_rows.size, d)
    cmp = leaf(1, plan.n_needed_slots, d)
    sink = leaf(heads, dtype=torch.float32)
    if device == "meta":
        sel = torch.zeros(1, plan.n_local, FLASH.topk, dtype=torch.long, device="meta")
    else:
        count = torch.as_tensor(plan.cmp_count)[None, :, None]
        pick = torch.randint(0, 1 << 30, (1, plan.n_local, FLASH.topk), generator=gen)
        sel = torch.where(torch.arange(FLASH.topk) < count, pick % count.clamp(min=1), -1)
    return q, ori, cmp, plan, sel, sink


def saved_bytes(kernel: str, *, local_rows: int, heads: int, cp: int, device: str) -> int:
    """Bytes autograd keeps for backward from one CSA attention call (unique storages),
    through :func:`hp_cp_torch.attention.run_sparse_attention` (see
    :func:`_attention_inputs`). ``device="meta"`` counts without allocating (the small-op
    path would need gigabytes); a real device also runs backward."""
    import torch

    from hp_cp_torch.attention import run_sparse_attention

    q, ori, cmp, plan, sel, sink = _attention_inputs(local_rows, heads, cp, device)
    seen: dict[Any, int] = {}
    keep: list[Any] = []

    def pack(t: Any) -> Any:
        base = t._base if t._base is not None else t
        keep.append(base)
        st = t.untyped_storage()
        key = id(base) if device == "meta" else st.data_ptr()
        seen[key] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_sparse_attention(q, ori, cmp, plan, sel, sink, q.shape[-1] ** -0.5, kernel=kernel)
    if device != "meta":
        out.float().square().sum().backward()
    return int(sum(seen.values()))


def peak_memory_bytes(kernel: str, *, local_rows: int, heads: int, cp: int) -> int | None:
    """Peak resident-memory growth (bytes) of one CSA attention forward + backward on the
    CPU (Linux: the high-water mark is reset through ``/proc/self/clear_refs``); ``None``
    where that is unavailable."""
    import gc

    from hp_cp_torch.attention import run_sparse_attention
    from hp_cp_torch.bench.memory import reset_peak, status_bytes

    q, ori, cmp, plan, sel, sink = _attention_inputs(local_rows, heads, cp, "cpu")
    gc.collect()
    if not reset_peak():  # VmHWM := VmRSS
        return None
    try:
        base = status_bytes("VmRSS")
        out = run_sparse_attention(q, ori, cmp, plan, sel, sink, q.shape[-1] ** -0.5, kernel=kernel)
        out.float().square().sum().backward()
        return status_bytes("VmHWM") - base
    except OSError:
        return None


# ----------------------------------------------------------------------------- charts

_FONT = {  # 3x5 glyphs, rows top to bottom
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    "A": "010101111101101",
    "B": "110101110101110",
    "C": "011100100100011",
    "D": "110101101101110",
    "E": "111100110100111",
    "F": "111100110100100",
    "G": "011100101101011",
    "H": "101101111101101",
    "I": "111010010010111",
    "J": "001001001101010",
    "K": "101101110101101",
    "L": "100100100100111",
    "M": "101111111101101",
    "N": "110101101101101",
    "O": "010101101101010",
    "P": "110101110100100",
    "Q": "010101101110011",
    "R": "110101110101101",
    "S": "011100010001110",
    "T": "111010010010010",
    "U": "101101101101111",
    "V": "101101101101010",
    "W": "101101111111101",
    "X": "101101010101101",
    "Y": "101101010010010",
    "Z": "111001010100111",
    ".": "000000000000010",
    "_": "000000000000111",
    "/": "001001010100100",
    "-": "000000111000000",
    "=": "000111000111000",
    ":": "000010000010000",
    "<": "001010100010001",
    ">": "100010001010100",
    " ": "000000000000000",
}


def _png_bytes(pixels: list[bytearray], width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def _bars_png_fallback(rows: list[tuple[str, float, float | None]], path: str) -> None:
    """Horizontal bars on a log2 axis from 1/64 to 16 (1 marked), 3x5 font scaled 2x."""
    scale, char_w = 2, 4
    label_w = max(len(r[0]) for r in rows) * char_w * scale + 10
    bar_w, row_h = 420, 24
    width, height = label_w + bar_w + 90, row_h * len(rows) + 30
    pix = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            pix[y][3 * x : 3 * x + 3] = bytes(rgb)

    def text(x: int, y: int, s: str, rgb=(0, 0, 0)) -> None:
        for i, ch in enumerate(s.upper()):
            glyph = _FONT.get(ch, _FONT[" "])
            for gy in range(5):
                for gx in range(3):
                    if glyph[gy * 3 + gx] == "1":
                        for dy in range(scale):
                            for dx in range(scale):
                                put(x + (i * char_w + gx) * scale + dx, y + gy * scale + dy, rgb)

    lo, hi = -6.0, 4.0

    def xpos(v: float) -> int:
        t = (min(max(math.log2(max(v, 1e-12)), lo), hi) - lo) / (hi - lo)
        return label_w + int(t * bar_w)

    for i, (label, value, target) in enumerate(rows):
        y0 = 20 + i * row_h
        text(4, y0 + 4, label)
        x1 = xpos(value)
        ok = target is None or value <= target
        color = (70, 130, 180) if ok else (220, 90, 60)
        for y in range(y0 + 3, y0 + row_h - 5):
            for x in range(label_w, max(x1, label_w + 1)):
                put(x, y, color)
        if target is not None:
            xt = xpos(target)
            for y in range(y0, y0 + row_h - 2):
                put(xt, y, (0, 0, 0))
        text(label_w + bar_w + 6, y0 + 4, f"{value:.4g}")
    for y in range(12, height - 4):  # the 1.0 line
        put(xpos(1.0), y, (120, 120, 120))
    text(label_w, 2, "LOG2 AXIS 1/64 .. 16   BLACK TICK: TARGET   GREY LINE: 1")
    with open(path, "wb") as f:
        f.write(_png_bytes(pix, width, height))


def write_png(rows: list[tuple[str, float, float | None]], path: str) -> str:
    """Bar chart of ``(label, value, target or None)``; returns the renderer used."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - any import failure means: use the fallback
        _bars_png_fallback(rows, path)
        return "builtin"
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.2))
    names = [r[0] for r in rows][::-1]
    values = [max(r[1], 1e-6) for r in rows][::-1]
    colors = ["tab:blue" if t is None or v <= t else "tab:red" for (_, v, t) in rows][::-1]
    ax.barh(names, values, color=colors)
    for i, (_, _, t) in enumerate(rows[::-1]):
        if t is not None:
            ax.plot([t, t], [i - 0.4, i + 0.4], color="black")
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ratio (black tick: target)")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.4g}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


# ----------------------------------------------------------------------------- main

TRAFFIC_TARGET_KEYS = [
    f"comm_{what}_{lay}_r{r}"
    for what in ("max_rank_over_own_lower_bound", "total_over_sum_lower_bounds")
    for lay in ("contiguous", "balanced")
    for r in RATIOS
]
TARGETS = {
    **dict.fromkeys(TRAFFIC_TARGET_KEYS, 1.05),
    "work_max_over_mean_balanced_r4": 1.05,
    "work_max_over_mean_balanced_r128": 1.05,
    "plan_build_seconds_s1m_cp8": 0.2,
    "saved_bytes_efficient_over_smallop": 0.15,
    "step_time_cp2_over_cp1": 0.55,
    "cp_enabled_cp1_overhead": 1.05,
    "host_syncs_per_step": 1.0,  # the bench's model runs one forward per step
    "store_ops_per_step": 0.0,
    "exposed_comm_fraction_cp4": 0.5,
}
"""Upper targets of the headline measures (the README's measures)."""

LOWER_TARGETS = {"attn_flops_over_matmul_r4": 0.4}
"""Lower targets (higher is better)."""


def _lower_is_better_rows(res: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    rows = []
    for key in (
        *TRAFFIC_TARGET_KEYS,
        *[
            f"{peer}_bytes_over_ours_r{r}"
            for peer in ("mindformers_allgather", "ulysses")
            for r in RATIOS
        ],
        *[f"work_max_over_mean_{lay}_r{r}" for lay in ("contiguous", "balanced") for r in (4, 128)],
        "plan_build_seconds_s1m_cp8",
        "saved_bytes_efficient_over_smallop",
        "step_time_cp2_over_cp1",
        "cp_enabled_cp1_overhead",
        "host_syncs_per_step",
        "store_ops_per_step",
        "exposed_comm_fraction_cp4",
        "exposed_comm_fraction_cp4_blocking",
    ):
        if key in res:
            rows.append((key, float(res[key]), TARGETS.get(key)))
    return rows


def _desync_worker(rank: int, world: int, calls: int) -> dict[str, float]:
    """Median seconds of one desync record (``CollectiveLog.enter``: in memory) and of
    one small gloo all-gather (64 floats), interleaved in rounds of ``calls`` each."""
    import statistics

    import torch
    import torch.distributed as dist

    from hp_cp_torch.distributed.desync import CollectiveLog, group_store

    log = CollectiveLog(rank, world, group_store(list(range(world))))
    small = torch.zeros(64)
    out = torch.empty(64 * world)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    record, gather = [], []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            log.enter("all_gather backward (reduce_scatter)", 12)
        record.append((time.perf_counter() - t0) / calls)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            all_gather(out, small)
        gather.append((time.perf_counter() - t0) / calls)
    return {"record_s": statistics.median(record), "gather_s": statistics.median(gather)}


def desync_cost(calls: int = 200) -> dict[str, float]:
    """The desync report's cost on 2 local gloo ranks (slower rank): seconds per record and
    its ratio to a small all-gather."""
    from hp_cp_torch.cli.launch import run_ranks

    ranks = run_ranks(2, _desync_worker, calls)
    record = max(r["record_s"] for r in ranks)
    gather = max(r["gather_s"] for r in ranks)
    return {
        "desync_record_us": record * 1e6,
        "desync_record_over_small_all_gather": record / gather,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"seq": args.seq, "cp": args.cp}
    res.update({f"shapes_{k}": v for k, v in asdict(FLASH).items()})
    t_start = time.perf_counter()

    res.update(traffic_measures(args.seq, args.cp))  # traffic (exact)
    res.update(dsa_traffic_measures(args.seq, args.cp))  # the family's new layer kinds
    # work (exact)
    for r in (0, 4, 128):
        for lay, name in (("contiguous", "contiguous"), ("load_balanced", "balanced")):
            w = work_per_rank(args.seq, args.cp, r, lay)
            res[f"work_max_over_mean_{name}_r{r}"] = _max_over_mean(w["plan"])
            res[f"work_impl_max_over_mean_{name}_r{r}"] = _max_over_mean(w["impl"])
            res[f"work_impl_over_plan_max_rank_{name}_r{r}"] = float(
                w["impl"].max() / w["plan"].max()
            )
            res[f"work_macs_per_rank_{name}_r{r}"] = w["plan"].tolist()
    res["time_exact_measures_s"] = time.perf_counter() - t_start

    # plan build (timed)
    worst = {"wall": 0.0, "cpu": 0.0}
    for lay in ("contiguous", "load_balanced"):
        secs = plan_build_seconds(args.plan_tokens, args.cp, args.plan_docs, lay, repeat=3)
        for clock, values in secs.items():
            suffix = "_cpu" if clock == "cpu" else ""
            res[f"plan_build_seconds_{lay}{suffix}_per_rank"] = values
            worst[clock] = max(worst[clock], max(values))
    res["plan_build_seconds_s1m_cp8"] = worst["wall"]
    res["plan_build_seconds_s1m_cp8_cpu"] = worst["cpu"]
    res["plan_build_tokens"] = args.plan_tokens

    # saved activations (exact, counted by autograd hooks)
    heads = args.saved_heads
    eff = saved_bytes(
        "efficient", local_rows=args.saved_rows, heads=heads, cp=args.cp, device="meta"
    )
    small = saved_bytes(
        "smallop", local_rows=args.saved_rows, heads=heads, cp=args.cp, device="meta"
    )
    res["saved_bytes_efficient"] = eff
    res["saved_bytes_smallop"] = small
    res["saved_bytes_efficient_over_smallop"] = eff / small
    res["saved_bytes_setup"] = (
        f"one CSA attention call, L={args.saved_rows} local rows of the last of cp={args.cp} "
        f"ranks, H={heads}, D={FLASH.head_dim}, K={FLASH.window}+{FLASH.topk}, bf16, meta device"
    )
    if args.check_rows:  # the meta count against a real run (forward and backward)
        for kernel in ("efficient", "smallop"):
            meta = saved_bytes(
                kernel, local_rows=args.check_rows, heads=heads, cp=args.cp, device="meta"
            )
            real = saved_bytes(
                kernel, local_rows=args.check_rows, heads=heads, cp=args.cp, device="cpu"
            )
            res[f"saved_bytes_{kernel}_real_over_meta_l{args.check_rows}"] = real / meta

    # peak memory of the attention call, forward + backward (measured on this machine)
    if args.peak_rows:
        peaks = {}
        for kernel in ("efficient", "smallop"):
            peaks[kernel] = peak_memory_bytes(
                kernel, local_rows=args.peak_rows, heads=heads, cp=args.cp
            )
            if peaks[kernel] is not None:
                res[f"peak_memory_bytes_{kernel}_l{args.peak_rows}"] = peaks[kernel]
        if peaks["efficient"] and peaks["smallop"]:
            res["peak_memory_efficient_over_smallop"] = peaks["efficient"] / peaks["smallop"]
            res["peak_memory_rows"] = args.peak_rows

    # step time through the CP path (timed): hp_cp_torch.bench.scaling
    if args.step_seq:
        from hp_cp_torch.bench.scaling import scaling_measures

        res.update(scaling_measures(args.step_seq, args.repeat))

    # the attention kernel against torch.matmul (timed): hp_cp_torch.bench.kernel
    if args.kernel_repeat:
        from hp_cp_torch.bench.kernel import kernel_measures

        kernels = tuple(k for k in args.kernels.split(",") if k)
        res.update(kernel_measures(kernels, repeat=args.kernel_repeat))

    # a HF model's training-step memory, cp = 4 over one device: hp_cp_torch.bench.memory
    if args.hf_mem_seqs:
        from hp_cp_torch.bench.memory import hf_memory_measures

        seqs = tuple(int(v) for v in args.hf_mem_seqs.split(","))
        res.update(hf_memory_measures(seqs, search=not args.no_hf_max_seq))

    # the steady-state hot path (counted): host reads, store ops, agreements per step
    if args.hotpath_steps:
        from hp_cp_torch.bench.hotpath import hotpath_measures

        res.update(hotpath_measures(steps=args.hotpath_steps))

    # the share of a slow link's latency in the step, overlapped and blocking (timed)
    if args.overlap_seq:
        from hp_cp_torch.bench.overlap import overlap_measures

        res.update(overlap_measures(seq=args.overlap_seq))

    # the desync report's record (timed): one in-memory entry per collective entered
    res.update(desync_cost())
    step = res.get("step_cp2_{}_s".format(res.get("step_time_cp2_headline_variant", "")))
    if step:  # a cp = 2 layer step enters 5 collectives (3 forward, 2 backward)
        res["desync_record_share_of_cp2_step"] = 5 * res["desync_record_us"] * 1e-6 / step
    res["time_total_s"] = time.perf_counter() - t_start
    return res


def _table(res: dict[str, Any]) -> str:
    from hp_cp_torch.kernels.banded import PICK_READS

    lines = [f"{'measure':<48} {'value':>10} {'target':>8}"]
    for key, value, target in _lower_is_better_rows(res):
        mark = "" if target is None else ("ok" if value <= target else "MISS")
        tgt = "" if target is None else f"<= {target:g}"
        lines.append(f"{key:<48} {value:>10.4g} {tgt:>8} {mark}")
    for key in (
        "comm_allgather_fallback_max_rank_over_own_lower_bound_contiguous_r4",
        "comm_allgather_fallback_total_over_sum_lower_bounds_contiguous_r4",
        "peak_memory_efficient_over_smallop",
        "step_time_cp2_headline_variant",
        "step_time_cp2_over_cp1_best",
        "step_cp1_concurrent_over_alone",
        *[
            f"step_time_cp2_over_cp1_{lay}_{ker}{c}"
            for lay, ker in STEP_VARIANTS
            for c in ("", "_cpu")
        ],
        "step_plain_layer_s",
        "desync_record_us",
        "desync_record_over_small_all_gather",
        "desync_record_share_of_cp2_step",
        "cp_enabled_cp1_overhead_cpu",
        "cp_enabled_cp1_overhead_swa",
        *[f"attn_flops_over_matmul_{c}" for c in ("r4", "r4_gathered", "r128")],
        *[
            f"attn_flops_over_matmul_{c}_{p}"
            for c in ("r4", "r4_gathered", "r128")
            for p in PICK_READS
        ],
        *[
            f"attn_flops_over_matmul_{k}_{c}"
            for k in ("efficient", "smallop")
            for c in ("r4", "r4_gathered", "r128")
        ],
        "matmul_gflops",
        "hf_peak_mem_cp4_over_single",
        "hf_max_seq_single",
        "hf_max_seq_cp4",
        "hf_max_seq_cp4_over_single",
        "hf_max_seq_single_est",
        "hf_max_seq_cp4_est",
        "time_total_s",
    ):
        if key in res:
            v, low = res[key], LOWER_TARGETS.get(key)
            mark = "" if low is None else f">= {low:g} " + ("ok" if v >= low else "MISS")
            text = f"{v:>10.4g}" if isinstance(v, float) else f"{v:>10}"
            lines.append(f"{key:<48} {text} {mark}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``hp-cp bench``: write bench.json and a PNG chart, print a table."""
    parser = argparse.ArgumentParser(prog="hp-cp bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench.json", help="JSON path (default ./bench.json)")
    parser.add_argument("--png", default=None, help="PNG path (default: next to the JSON)")
    parser.add_argument("--seq", type=int, default=131072, help="S of the exact measures")
    parser.add_argument("--cp", type=int, default=8, help="cp of the exact measures")
    parser.add_argument("--plan-tokens", type=int, default=1_048_576)
    parser.add_argument("--plan-docs", type=int, default=64)
    parser.add_argument("--saved-rows", type=int, default=4096)
    parser.add_argument("--saved-heads", type=int, default=8)
    parser.add_argument(
        "--check-rows",
        type=int,
        default=128,
        help="also run the saved-bytes count for real at this L (0: skip)",
    )
    parser.add_argument(
        "--peak-rows",
        type=int,
        default=512,
        help="L of the peak-memory run of the attention call (0: skip)",
    )
    parser.add_argument("--step-seq", type=int, default=8192, help="S of the step time (0: skip)")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds of the step time")
    parser.add_argument(
        "--kernel-repeat",
        type=int,
        default=2,
        help="timed runs of the kernel FLOP/s measure (0: skip)",
    )
    parser.add_argument(
        "--kernels",
        default="banded,efficient",
        help="kernels of the FLOP/s measure (the default kernel first)",
    )
    parser.add_argument(
        "--hf-mem-seqs",
        default="512,1024,2048",
        help="S of the HF training-step memory measure ('': skip)",
    )
    parser.add_argument(
        "--no-hf-max-seq",
        action="store_true",
        help="skip the search for the longest S that fits (real steps; a few minutes)",
    )
    parser.add_argument(
        "--hotpath-steps",
        type=int,
        default=3,
        help="counted steady-state steps of the host-sync / store-op measure (0: skip)",
    )
    parser.add_argument(
        "--overlap-seq",
        type=int,
        default=512,
        help="S of the exposed-communication measure at cp 4 (0: skip)",
    )
    long = parser.add_argument_group(
        "long", "--long: one training step at cp 8 for long S (hp_cp_torch.bench.long)"
    )
    long.add_argument("--long", action="store_true", help="run the long-S bench only")
    long.add_argument(
        "--long-seqs",
        default="65536,131072,262144,524288,1048576",
        help="S of the cp-8 steps ('': none, the paper measures only)",
    )
    long.add_argument("--long-cp", type=int, default=8)
    long.add_argument("--long-parity-seq", type=int, default=131072)
    long.add_argument("--long-compare-seq", type=int, default=262144)
    long.add_argument(
        "--long-max-total-bytes",
        type=float,
        default=12 * 2**30,
        help="skip an S whose predicted memory, all ranks together, is above this",
    )
    long.add_argument(
        "--long-hf",
        action="store_true",
        help="also the HF model's longest S at cp 4 and cp 8 under one per-rank budget "
        "(hf_max_seq_cp8; real training steps, about an hour on 2 cores)",
    )
    long.add_argument("--long-out", default="bench-long.json")
    long.add_argument(
        "--no-long-paper", action="store_true", help="skip the scale-on-paper measures"
    )
    long.add_argument(
        "--long-merge",
        action="store_true",
        help="add the keys to an existing --long-out file instead of replacing it",
    )
    real = parser.add_argument_group(
        "real widths",
        "--real-widths: bf16 training steps of V4-Flash, V3.2 and GLM-5 at their published "
        "attention widths under CP (hp_cp_torch.bench.real_widths)",
    )
    real.add_argument("--real-widths", action="store_true", help="run the real-widths bench only")
    real.add_argument("--real-models", default="deepseek_v4,deepseek_v32,glm_moe_dsa")
    real.add_argument("--real-seqs", default="4096,8192", help="S of the steps, smallest first")
    real.add_argument("--real-cps", default="4,8", help="cp of the steps")
    real.add_argument(
        "--real-regather", default="off,on", help="regather_compressed_kv: off, on or both"
    )
    real.add_argument(
        "--real-no-single", action="store_true", help="skip the one-process (HF eager) steps"
    )
    real.add_argument(
        "--real-no-profile", action="store_true", help="skip the profiled step (live peak, ops)"
    )
    real.add_argument(
        "--real-max-total-bytes",
        type=float,
        default=20 * 2**30,
        help="skip a point whose predicted memory, all ranks together, is above this",
    )
    real.add_argument(
        "--real-time-limit", type=float, default=3600, help="seconds one point's launch may run"
    )
    real.add_argument(
        "--real-out", default="bench-real.json", help="JSON the points are merged into"
    )
    real.add_argument(
        "--real-allgather",
        action="store_true",
        help="also the all-gather CP baseline of bench/peers_dsa.py (V3.2, GLM-5; a checkout)",
    )
    mega = parser.add_argument_group(
        "megatron",
        "--megatron: one step of a megatron-core GPTModel of MLA + DSA layers under Megatron's "
        "own all-gather CP and under hp_cp, side by side (hp_cp_torch.bench.megatron; a checkout)",
    )
    mega.add_argument("--megatron", action="store_true", help="run the Megatron bench only")
    mega.add_argument(
        "--megatron-cells",
        default="grid",
        help="'grid' (heads {8,32,64} x S {2048,4096} x top-k {S/8,S/2} x cp {2,4}), 'quick' "
        "(one tiny cell) or heads:S:topk:cp,...",
    )
    mega.add_argument(
        "--megatron-kernel", default=None, help="hp_cp's attention_kernel (default: hp_cp's)"
    )
    mega.add_argument(
        "--megatron-host-gib",
        type=float,
        default=None,
        help="memory one cell's ranks may hold together (default: the host's available); "
        "Megatron's side of a cell estimated above it is skipped",
    )
    mega.add_argument("--megatron-out", default="bench-megatron.json")
    args = parser.parse_args(argv)
    if args.megatron:
        from hp_cp_torch.bench.megatron import main_megatron

        return main_megatron(args)
    if args.real_widths:
        from hp_cp_torch.bench.real_widths import main_real

        return main_real(args)
    if args.long:
        from hp_cp_torch.bench.long import main_long

        return main_long(args)
    if args.hf_mem_seqs and importlib.util.find_spec("transformers") is None:
        # refuse now rather than after the other measures have run for minutes
        parser.error(
            "the HF memory measure (--hf-mem-seqs) needs transformers: "
            "pip install 'hp-cp-torch[bench]', or pass --hf-mem-seqs '' to skip it"
        )
    res = run(args)
    out = os.path.abspath(args.out)
    png = args.png or os.path.splitext(out)[0] + ".png"
    for path in (out, png):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    res["png_renderer"] = write_png(_lower_is_better_rows(res), png)
    numbers, notes = flatten_numbers(res)
    with open(out, "w") as f:
        json.dump(numbers, f, indent=1, sort_keys=True)
    with open(os.path.splitext(out)[0] + ".notes.json", "w") as f:
        json.dump(notes, f, indent=1, sort_keys=True)
    print(_table(res))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
