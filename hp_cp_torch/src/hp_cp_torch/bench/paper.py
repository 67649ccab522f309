"""Scale on paper: what one rank receives and keeps, and its plan time, at S = 1M, 4M, 16M and
cp = 8 ... 1024 for DeepSeek V4-Flash's layer schedule, from the core's plans alone (no
tensors, no process group).

Per (S, cp) and layer kind, the plan of rank 0 of the load-balanced layout (it holds the
last chunk, so its queries see every slot: the most slots to receive and keep) gives, in
bf16 (2 bytes per element) at Flash's shapes (:data:`~hp_cp_torch.bench.traffic.FLASH`:
hidden 4096, D = 512, indexer Di = 128, W = 128):

* ``recv``: forward bytes received, ``2 (window_rows D + x_rows hidden + slots_recv w)``
  with ``w = D + Di`` for CSA (main and indexer slots travel together), ``D`` for HCA;
  window_rows = W - 1 = 127 (the halo of its second chunk), x_rows = 4 for CSA (one
  predecessor block), slots_recv = S / r - S / (cp r) (every slot but its own);
* ``saved_keep``: the compressed state kept for backward without the option, ``2 w S / r``
  (the global buffer, every slot); ``saved_regather``: with ``regather_compressed_kv=True``,
  ``2 w S / (cp r)`` (its own slots only);
* ``plan_s``: wall seconds of ``build_rank_plan`` for that rank (best of one; this machine).

Summed over the 43 layers of the schedule :data:`FLASH_SCHEDULE` (2 sliding, 21 CSA,
20 HCA; plans are per layer kind, so the plan time counts each kind once).
"""

from __future__ import annotations

import time
from typing import Any

from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_torch.bench.traffic import FLASH, Shapes

__all__ = ["FLASH_SCHEDULE", "PAPER_CPS", "PAPER_SEQS", "paper_measures", "rank_numbers"]

FLASH_SCHEDULE = (0, 0, 4) + (128, 4) * 20
"""V4-Flash's compress ratios per layer (``[0, 0, 4] + [128, 4] * 20``, the MTP layer left
out): 2 sliding-window, 21 CSA, 20 HCA layers."""

PAPER_SEQS = (1 << 20, 1 << 22, 1 << 24)
PAPER_CPS = tuple(8 << i for i in range(8))  # 8 ... 1024


def rank_numbers(seq: int, cp: int, ratio: int, shapes: Shapes = FLASH) -> dict[str, float]:
    """``recv``, ``saved_keep``, ``saved_regather`` (bytes) and ``plan_s`` of rank 0, one
    layer of compress ratio ``ratio`` (see the module docstring)."""
    spec = LayerSpec(compress_ratio=ratio, window_size=shapes.window, has_indexer=ratio == 4)
    t0 = time.perf_counter()
    plan = build_rank_plan(
        rank=0, cp_size=cp, spec=spec, layout_kind="load_balanced", total_rows=seq
    )
    plan_s = time.perf_counter() - t0
    e, d = shapes.elem_bytes, shapes.head_dim
    width = d + (shapes.index_dim if ratio == 4 else 0)
    window_rows = int(sum(plan.window.recv_counts))
    x_rows = int(sum(plan.x.recv_counts)) if plan.x is not None else 0
    slots_recv = int(plan.slot_exchange.n_halo) if ratio else 0
    recv = e * (window_rows * d + x_rows * shapes.hidden + slots_recv * width)
    return {
        "recv": float(recv),
        "saved_keep": float(e * width * plan.n_needed_slots) if ratio else 0.0,
        "saved_regather": float(e * width * len(plan.owned_slots)) if ratio else 0.0,
        "plan_s": plan_s,
        "slots_recv": float(slots_recv),
        "window_rows": float(window_rows),
        "x_rows": float(x_rows),
    }


def paper_measures(
    seqs: tuple[int, ...] = PAPER_SEQS,
    cps: tuple[int, ...] = PAPER_CPS,
    schedule: tuple[int, ...] = FLASH_SCHEDULE,
) -> dict[str, Any]:
    """The ``paper_*`` keys: per (S, cp), the schedule's sums for rank 0."""
    res: dict[str, Any] = {
        "paper_schedule_layers": len(schedule),
        **{f"paper_schedule_r{r}_layers": schedule.count(r) for r in sorted(set(schedule))},
    }
    t_all = time.perf_counter()
    for seq in seqs:
        for cp in cps:
            per_kind = {r: rank_numbers(seq, cp, r) for r in sorted(set(schedule))}
            key = f"paper_s{seq}_cp{cp}"
            for what in ("recv", "saved_keep", "saved_regather"):
                res[f"{key}_{what}_bytes"] = sum(per_kind[r][what] for r in schedule)
            res[f"{key}_plan_seconds"] = sum(v["plan_s"] for v in per_kind.values())
            res[f"{key}_plan_seconds_r4"] = per_kind.get(4, {}).get("plan_s", 0.0)
    res["paper_time_total_s"] = time.perf_counter() - t_all
    return res
