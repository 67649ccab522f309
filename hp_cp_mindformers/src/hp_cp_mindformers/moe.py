"""The MoE load-balancing loss under CP: the routers' token statistics over the CP group.

Note [MoE aux loss under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
mindformers 2.1.0's ``TopKRouter`` computes its auxiliary loss (``aux_loss``,
``seq_aux_loss``, ``global_aux_loss``; ``moe_aux_loss_coeff > 0``) from how many tokens chose
each expert. Under CP a rank routes only its own rows, so the counts must be summed over the
CP group and the token total scaled by cp; each rank then attaches its share (its rows'
router probabilities against the global counts) and the shares' gradients sum to the
one-device ones::

    one device   f_e = count_e(all rows) / T            loss = sum_e P_e(all rows) * f_e
    cp ranks     f_e = allreduce(count_e(own rows)) / T  share_k = sum_e P_e(own rows) * f_e

MindFormers' own ``parallelize`` step sets the counts' group per router
(``router.enable_sequence_parallel(tp_group, tp_size, cp_groups, cp_size)``); while a model
runs under hp_cp the install does the same with the hp_cp group (its TP group kept), and
``disable_cp`` restores what was there. The counts' all-reduce is MindFormers' own
(``hyper_parallel``'s ``differentiable_all_reduce``). The install does NOT touch MindFormers'
process-wide aux-loss group size (``set_moe_aux_loss_group_info``): the router multiplies its
gradient by it (cp) for a trainer that AVERAGES gradients over CP, while hp_cp's convention is
to SUM them (each rank's loss share over the global token count), under which the shares'
gradients already add up to the one-device ones. The logged aux loss
(``save_to_aux_losses_tracker``) is then the rank's share.

The router takes no padding mask: rows that ``handle.shard(..., pad_value=...)`` appended are
routed and counted like real ones, so with padding to fit the aux loss is not the one of the
unpadded sequence (pick S a multiple of cp, 2 * cp load-balanced, when training with it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindspore import nn

__all__ = ["moe_routers", "put_routers_under_cp"]


def moe_routers(root: Any) -> list[nn.Cell]:
    """The MoE routers under ``root`` that take CP groups (``enable_sequence_parallel``)."""
    cells = getattr(root, "cells_and_names", None)
    if cells is None:
        return []
    found: dict[int, nn.Cell] = {}
    for _, cell in cells():
        router = getattr(cell, "router", None)
        if hasattr(router, "moe_aux_loss_coeff") and callable(
            getattr(router, "enable_sequence_parallel", None)
        ):
            found.setdefault(id(router), router)
    return list(found.values())


def put_routers_under_cp(
    routers: list[nn.Cell], group_name: str, cp_size: int
) -> Callable[[], None]:
    """Give every router the CP group (Note [MoE aux loss under CP]); returns the undo."""
    saved = [
        (
            r,
            getattr(r, "_tp_group", None),
            getattr(r, "_tp_size", 1),
            getattr(r, "_cp_groups", ()),
            getattr(r, "_cp_size", 1),
        )
        for r in routers
    ]
    for router, tp_group, tp_size, _, _ in saved:
        router.enable_sequence_parallel(tp_group, tp_size, (group_name,), int(cp_size))

    def undo() -> None:
        for router, tp_group, tp_size, cp_groups, size in saved:
            router.enable_sequence_parallel(tp_group, tp_size, cp_groups, size)

    return undo
