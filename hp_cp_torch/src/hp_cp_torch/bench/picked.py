"""The picked kernel's two strategies against each other, and grouped heads against one KV
head: ``python -m hp_cp_torch.bench.picked`` (``--out bench-picked.json``).

* ``picked_<heads>h_k<k>_n<n/k>_{dense,gather}_s``: forward + backward seconds of one block of
  64 queries that each pick ``k`` distinct rows out of the same ``n`` visible rows, read as a
  dense masked band or gathered, at the published latent width (MLA, ``kv_lora_rank`` 512 +
  rope 64, heads of 128 + 64 / 128, ``kv_b_proj`` folded in), fp32, best of ``--repeat``;
  ``picked_<heads>h_k<k>_crossover``: the largest ``n / k`` measured at which the band is
  no slower (the kernel's :func:`~hp_cp_torch.kernels.picked.band_factor` is written from
  these, Note [Picked attention: dense band or gather, per block]).
* ``grouped_kv<G>_over_kv1_s<S>``: a whole DSA layer's attention (S on one rank, top-k 256,
  8 query heads of 128, keys apart from values) with ``G`` KV heads over the same model with
  one KV head, forward + backward, at ``--seq`` and 4 times it (the longer S gathers more).

Run it alone on the machine: its numbers are ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_core.columns import DenseBlock
from hp_cp_torch.kernels.picked import HeadLayout, attend_blocks, picked_attention

__all__ = ["block_seconds", "grouped_ratio", "main"]

ROWS = 64
NOPE, ROPE, VALUE, RANK = 128, 64, 128, 512


def _best(fn: Any, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def block_seconds(heads: int, k: int, n: int, repeat: int = 3) -> dict[str, float]:
    """Seconds of one latent block (64 queries, ``k`` picks out of ``n`` rows), each way."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, ROWS, heads, NOPE + ROPE, generator=g, requires_grad=True)
    rows = torch.randn(1, n, RANK + ROPE, generator=g, requires_grad=True)
    up = (torch.randn(heads * (NOPE + VALUE), RANK, generator=g) * 0.05).requires_grad_()
    sel = torch.rand(1, ROWS, n, generator=g).topk(k, dim=-1).indices
    layout = HeadLayout.mla(NOPE, ROPE, VALUE, RANK)
    none = np.zeros(0, dtype=np.int64)
    out: dict[str, float] = {}
    for name, band in (("dense", True), ("gather", False)):
        block = DenseBlock(0, ROWS, 0, 0, none, none, 0, n, picks_in_band=band)

        def step(block: DenseBlock = block) -> None:
            o = attend_blocks(q, rows, sel, [block], layout, 0.1, None, up)
            torch.autograd.grad(o.sum(), (q, rows, up))

        out[name] = _best(step, repeat)
    return out


def grouped_ratio(kv_heads: int, seq: int, topk: int, repeat: int = 3) -> float:
    """A DSA layer's attention with ``kv_heads`` KV heads over one KV head, forward +
    backward (8 query heads of 128, keys apart from values, auto strategy)."""
    spec = LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)
    plan = build_rank_plan(rank=0, cp_size=1, spec=spec, layout_kind="contiguous", total_rows=seq)
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(1, seq, seq, generator=g).masked_fill(
        torch.ones(seq, seq, dtype=torch.bool).triu(1), -1.0
    )
    k = min(topk, seq)
    sel = scores.topk(k, dim=-1).indices
    sel = torch.where(torch.arange(k) <= torch.arange(seq)[:, None], sel, -1)
    times = {}
    for groups in (1, kv_heads):
        layout = HeadLayout.grouped(groups, 128, 128)
        q = torch.randn(1, seq, 8, 128, generator=g, requires_grad=True)
        rows = torch.randn(1, seq, layout.row_width, generator=g, requires_grad=True)

        def step(q: Any = q, rows: Any = rows, layout: HeadLayout = layout) -> None:
            o = picked_attention(q, rows, sel, plan, layout, 0.1)
            torch.autograd.grad(o.sum(), (q, rows))

        times[groups] = _best(step, repeat)
    return times[kv_heads] / times[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hp_cp_torch.bench.picked")
    parser.add_argument("--out", default="bench-picked.json")
    parser.add_argument("--heads", default="8,16,32,64,128")
    parser.add_argument("--topk", default="256,1024")
    parser.add_argument("--factors", default="1,2,4,8")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=("all", "blocks", "grouped"), default="all")
    args = parser.parse_args(argv)
    res: dict[str, Any] = {"threads": torch.get_num_threads()}
    factors = [int(f) for f in args.factors.split(",")]
    heads_list = [] if args.only == "grouped" else [int(h) for h in args.heads.split(",")]
    for heads in heads_list:
        for k in (int(t) for t in args.topk.split(",")):
            cross = 0
            for f in factors:
                t = block_seconds(heads, k, f * k, args.repeat)
                for name, sec in t.items():
                    res[f"picked_{heads}h_k{k}_n{f}_{name}_s"] = sec
                if t["dense"] <= t["gather"]:
                    cross = f
                print(
                    f"heads {heads} k {k} n {f}k: dense {t['dense']:.3f}s gather "
                    f"{t['gather']:.3f}s",
                    flush=True,
                )
            res[f"picked_{heads}h_k{k}_crossover"] = cross
    for seq in () if args.only == "blocks" else (args.seq, 4 * args.seq):
        for groups in (2, 4, 8):
            ratio = grouped_ratio(groups, seq, 256, args.repeat)
            res[f"grouped_kv{groups}_over_kv1_s{seq}"] = ratio
            print(f"S {seq}: {groups} KV heads over 1: {ratio:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
