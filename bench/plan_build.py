"""Time ``build_rank_plan`` for every rank of one large packed sequence (not a test).

Default: S = 1,048,576 tokens, cp = 8, r = 4 (CSA with indexer), 64 random documents, both
layouts. Prints JSON with the max and mean seconds per rank (first build, i.e. a plan-cache
miss; the best of ``--repeat`` runs per rank).

    python bench/plan_build.py [--tokens N] [--cp 8] [--ratio 4] [--docs 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from hp_cp_core import LayerSpec, build_rank_plan


def random_cu_seqlens(tokens: int, docs: int, seed: int) -> np.ndarray:
    """``docs`` documents of random lengths (at least 1 row each) summing to ``tokens``."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=docs - 1, replace=False))
    return np.concatenate([[0], cuts, [tokens]]).astype(np.int64)


def time_layout(spec: LayerSpec, layout: str, tokens: int, cp: int, cu, repeat: int) -> dict:
    per_rank = []
    for rank in range(cp):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            build_rank_plan(
                rank=rank,
                cp_size=cp,
                spec=spec,
                layout_kind=layout,
                total_rows=tokens,
                cu_seqlens=cu,
            )
            best = min(best, time.perf_counter() - t0)
        per_rank.append(best)
    return {
        "layout": layout,
        "max_s": max(per_rank),
        "mean_s": sum(per_rank) / len(per_rank),
        "per_rank_s": per_rank,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_048_576)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--grid", default="per_document", choices=["per_document", "global"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    spec = LayerSpec(
        compress_ratio=args.ratio,
        window_size=args.window,
        has_indexer=args.ratio == 4,
        packed_grid=args.grid,
    )
    cu = random_cu_seqlens(args.tokens, args.docs, args.seed)
    # warm numpy up once so the first rank does not pay import / allocation costs
    build_rank_plan(
        rank=0,
        cp_size=args.cp,
        spec=spec,
        layout_kind="contiguous",
        total_rows=args.tokens,
        cu_seqlens=cu,
    )
    results = [
        time_layout(spec, layout, args.tokens, args.cp, cu, args.repeat)
        for layout in ("contiguous", "load_balanced")
    ]
    print(
        json.dumps(
            {
                "benchmark": "build_rank_plan",
                "tokens": args.tokens,
                "cp": args.cp,
                "compress_ratio": args.ratio,
                "window_size": args.window,
                "docs": args.docs,
                "grid": args.grid,
                "numpy": np.__version__,
                "python": platform.python_version(),
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
