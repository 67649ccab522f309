"""The exchanges of one layer, written against the :class:`~hp_cp_core.backend.Group` protocol.

One point-to-point message per peer carries the window KV halo and the x halo together; one
all-gather carries the main and indexer compressed slots together. See
Note [Halos and the ext frame] in :mod:`hp_cp_core.plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hp_cp_core.backend import Backend, Group
from hp_cp_core.plan import RankPlan


def exchange_halos(
    group: Group, ops: Backend, ori_kv: Any, x: Any, plan: RankPlan
) -> tuple[Any, Any]:
    """Window KV halo and x halo in one exchange.

    Returns ``(ori_ext, halo_x)``: the window KV in the ext frame (``[halo ; local]`` for a
    contiguous layout) and the received x rows in ascending global order (``None`` for r = 0).
    """
    items = [(ori_kv, plan.window)]
    if plan.x is not None:
        items.append((x, plan.x))
    outs = group.exchange_rows(items)
    ori_ext = outs[0]
    if plan.window.ext_from_recv is not None:
        ori_ext = ops.index_rows(ori_ext, plan.window.ext_from_recv)
    halo_x = None
    if plan.x is not None:
        halo_x = ops.narrow(outs[1], 0, plan.x.n_halo)
        if plan.x.halo_gather is not None:
            halo_x = ops.index_rows(halo_x, plan.x.halo_gather)
    return ori_ext, halo_x


def gather_compressed_slots(
    group: Group, ops: Backend, owned: Sequence[Any], plan: RankPlan
) -> list[Any]:
    """All-gather every rank's owned slots of several compressors in one collective.

    Returns, per input, the rank-major padded buffer ``[cp * cap, (batch,) d]``; see
    :func:`~hp_cp_core.compression.select_and_pad_smallop` for putting it in global order.
    """
    flats = [ops.flatten_rows(t) for t in owned]
    widths = [ops.shape(f)[1] for f in flats]
    packed = ops.pad_rows(ops.cat_features(flats), plan.gather_cap)
    gathered = group.all_gather_rows(packed)
    parts = ops.split_features(gathered, widths)
    return [
        ops.unflatten_rows(p, (ops.shape(p)[0], *ops.shape(t)[1:])) for p, t in zip(parts, owned)
    ]
