"""Rank function of tests/torch/test_any_length.py: the reference layer on sequence lengths the
layouts cannot shard as they are, padded by ``handle.shard(..., pad_value=...)``.

One job of 4 gloo ranks runs every case (cp 2 and 3 on sub-groups, cp 4 on the world). Each
case pads x (zeros), the cotangent (zeros: padding rows are outside the loss) and, at even
lengths, a loss mask (ones padded with 0, the indexer loss's ``loss_mask``); odd lengths pass
no mask, so only the handle's record of what it padded keeps the padding rows out of the
indexer loss (Note [Padding to the layout] in hp_cp_core.padding). Packed input gets the
padding as its own trailing document (``handle.padding(S).cu_seqlens(cu)``). Rank 0 returns
the real rows of the output and input gradient (``handle.unshard(..., rows=S)``), the
parameter gradients summed over the group, the indexer loss and the indexer picks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from cases import Case, _sum_over_group, build_layer, capture_selection, make_inputs

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp

WINDOW = 16
LAYOUTS = ("contiguous", "load_balanced")


def lengths(cp: int, r: int) -> list[int]:
    """Sequence lengths 1 .. 3*cp*r + 1: every one for cp = 2, r = 4; else the boundaries
    (1, r-1, r, r+1, W-1, W, W+1, 2cp and k*cp*r for k = 1, 2, 3, each -1 and +1)."""
    top = 3 * cp * r + 1
    if cp == 2 and r == 4:
        return list(range(1, top + 1))
    picks = {1, r - 1, r, r + 1, WINDOW - 1, WINDOW, WINDOW + 1, 2 * cp - 1, 2 * cp, 2 * cp + 1}
    for k in (1, 2, 3):
        picks |= {k * cp * r - 1, k * cp * r, k * cp * r + 1}
    picks.add(top)
    return sorted(n for n in picks if 1 <= n <= top)


def packed_cu(rows: int, r: int, seed: int) -> tuple[int, ...]:
    """Documents of random lengths, one shorter than r, one empty, summing to ``rows``."""
    rng = np.random.default_rng(seed)
    cut = []
    at = 0
    while at < rows:
        n = int(rng.integers(1, max(r, 2))) if len(cut) % 2 else int(rng.integers(r, 3 * r + 2))
        at = min(at + n, rows)
        cut.append(at)
        if len(cut) == 2:
            cut.append(at)  # an empty document
    return (0, *cut)


def any_length_cases() -> list[Case]:
    """The grid: cp 2, 3, 4; both layouts; padded batch of 2 and packed; r = 4 over
    ``lengths``; a few HCA (r = 128) lengths at cp 2 and 4."""
    out = []
    for cp in (2, 3, 4):
        for layout in LAYOUTS:
            for packed in (False, True):
                for rows in lengths(cp, 4):
                    cu = packed_cu(rows, 4, rows) if packed else None
                    out.append(Case(cp, 4, layout, packed, rows=rows, cu=cu, window=WINDOW))
                if cp in (2, 4):
                    for rows in (1, 127, 129, 3 * cp * 128 + 1):
                        cu = packed_cu(rows, 128, rows) if packed else None
                        out.append(Case(cp, 128, layout, packed, rows=rows, cu=cu, window=WINDOW))
    return out


def run_case(case: Case, group: Any) -> dict[str, Any] | None:
    """One padded CP forward + backward (training mode: the CSA indexer loss included)."""
    layer = build_layer(case)
    x, cu, g = make_inputs(case)
    config = DeepSeekV4CPConfig(layout=case.layout)
    handle = enable_cp(layer, group, config)
    try:
        dim = 0 if case.packed else 1
        pad = handle.padding(case.total)
        xl = handle.shard(x, dim, pad_value=0.0).requires_grad_(True)
        gl = handle.shard(g, dim, pad_value=0.0)
        kwargs: dict[str, Any] = {}
        if case.total % 2 == 0:
            kwargs["loss_mask"] = handle.shard(torch.ones(x.shape[: dim + 1]), dim, pad_value=0)
        if case.packed:
            kwargs["cu_seqlens"] = torch.as_tensor(pad.cu_seqlens(cu.numpy()))
        elif case.layout == "contiguous":
            kwargs["position_ids"] = handle.shard(torch.arange(pad.padded_rows), 0)
        with capture_selection() as picks:
            out = layer(xl, **kwargs)
        params = dict(layer.named_parameters())
        loss = (out.float() * gl.float()).sum()
        grads = torch.autograd.grad(loss, [xl, *params.values()], allow_unused=True)
        res = {
            "padded_rows": pad.padded_rows,
            "out": handle.unshard(out.detach(), dim, rows=case.total),
            "gx": handle.unshard(grads[0].detach(), dim, rows=case.total),
            "pgrads": {
                n: _sum_over_group(gr, p, group) for (n, p), gr in zip(params.items(), grads[1:])
            },
            "indexer_loss": layer.indexer_loss,
            "sel": handle.unshard(picks[0], 1, rows=case.total) if picks else None,
        }
    finally:
        disable_cp(handle)
    return res if dist.get_rank(group) == 0 else None


def any_length_suite(rank: int, world: int) -> dict[str, Any]:
    """Every case on its cp sub-group; rank 0 returns ``{case name: result or traceback}``."""
    import traceback

    assert world == 4
    torch.set_num_threads(1)
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    results: dict[str, Any] = {}
    for case in any_length_cases():
        if rank >= case.cp:
            continue
        try:
            got = run_case(case, groups[case.cp])
        except Exception:  # noqa: BLE001 - reported by the test; peers fail their case too
            got = f"rank {rank}:\n{traceback.format_exc()}"
            results[case.name] = got
            break
        if rank == 0:
            results[case.name] = got
    return results
