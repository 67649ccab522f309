"""Stage 1 (compress the owned slots, reading the x halo) and stage 2 (gather every rank's
slots into global order). See Note [Compressed slots and visibility] in
:mod:`hp_cp_core.indices`.

Note [Re-gathered slots]
~~~~~~~~~~~~~~~~~~~~~~~~
The global compressed KV (and, for r = 4, the indexer keys) of a layer holds every slot an
earlier rank's rows made: ``S / r`` rows on the last rank, whatever cp is. The attention
kernels keep it for backward, so over a model's layers it is the part of what a rank saves
that cp does not divide (at V4-Flash's head_dim 512, 21 CSA layers, S = 1M: about 7 GB per
rank). With ``CPConfig(regather_compressed_kv=True)`` a backend that offers
``Group.regather_scope`` keeps only this rank's own slots, and the layer's backward receives
the others again before any of its attention backward runs::

    forward   exchange slots -> buffers -> attention (saves views of the buffers as handles)
                 owned slots kept                       buffers freed after the layer
    backward  end_order's backward: regather_compressed_kv (one slot exchange, no autograd)
                 -> the same buffers, bit for bit -> attention backward -> slot exchange bwd

The re-exchange runs inside the backward of the layer's last node (``end_order``), which every
rank runs before any other backward of the layer and after the layers above finished theirs
(Note [Backward order] in :mod:`hp_cp_core.collectives`), so it is in one place of every
rank's order, also on a rank whose queries read no slot (its peers may need its slots). It
moves the forward's slot bytes once more per layer and step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from hp_cp_core.backend import Backend, Group
from hp_cp_core.collectives import (
    exchange_compressed_slots,
    gather_compressed_slots,
    slot_exchange_kind,
)
from hp_cp_core.config import CPContext
from hp_cp_core.plan import RankPlan
from hp_cp_core.slot_exchange import SlotExchangePlan

CompressFn = Callable[[Any, int], Any]


def build_x_ext(ops: Backend, x: Any, halo_x: Any, plan: RankPlan) -> Any:
    """``[halo_x ; x]`` rearranged into the x ext frame (ascending global rows)."""
    x_cat = ops.cat([halo_x, x]) if halo_x is not None else x
    gather = plan.x.ext_from_halo if plan.x is not None else None
    return ops.index_rows(x_cat, gather) if gather is not None else x_cat


def stage1_compress_with_halo(compress_fn: CompressFn, x: Any, halo_x: Any, call: CPContext) -> Any:
    """This rank's owned slots, in global slot order, from its rows plus the x halo.

    ``compress_fn(rows, rope_pos_offset)`` must compress every complete block of r rows of
    its sequence-major input (overlap within the input for r = 4; the first block's missing
    predecessor filled with kv = 0 / score = -inf) with slot j at RoPE position
    ``rope_pos_offset + j*r``. Each :class:`~hp_cp_core.plan.CompressSegment` starts one block
    early when its first slot needs a predecessor; that helper slot is dropped.
    """
    ops, plan = call.ops, call.plan
    x_ext = build_x_ext(ops, x, halo_x, plan)
    outs = []
    for seg in plan.segments:
        rows = ops.narrow(x_ext, seg.ext_start, seg.ext_stop - seg.ext_start)
        out = compress_fn(rows, seg.rope_pos_offset)
        if seg.drop_first:
            out = ops.narrow(out, 1, seg.n_slots)
        outs.append(out)
    if not outs:  # no owned slot: an empty result with the compressor's own trailing shape
        return compress_fn(ops.narrow(x_ext, 0, 0), 0)
    return outs[0] if len(outs) == 1 else ops.cat(outs)


def select_and_pad_smallop(ops: Backend, gathered: Any, plan: RankPlan) -> Any:
    """Global slots ``0 .. plan.n_needed_slots - 1`` picked out of the padded all-gather."""
    return ops.index_rows(gathered, plan.gather_index[: plan.n_needed_slots])


def slot_buffer(ops: Backend, exchanged: Any, slots: SlotExchangePlan) -> Any:
    """Global slots ``0 .. slots.n_buffer - 1`` out of ``[received ; owned]`` (a zero row
    stands for the slots no local query sees; Note [Causal-prefix slot exchange])."""
    if slots.buffer_index is None:
        return ops.narrow(exchanged, 0, slots.n_buffer)
    shape = ops.shape(exchanged)
    flat = ops.flatten_rows(exchanged)
    if slots.n_filler:
        flat = ops.pad_rows(flat, shape[0] + 1)
    picked = ops.index_rows(flat, slots.buffer_index)
    return ops.unflatten_rows(picked, (slots.n_buffer, *shape[1:]))


def build_global_compressed_kv_for_cp(
    group: Group,
    ops: Backend,
    owned: Sequence[Any],
    plan: RankPlan,
    token: Any,
    work: Any = None,
    overlap: bool = False,
) -> tuple[list[Any], Any]:
    """Every rank's owned slots (main, then indexer) in global slot order ``0 ..
    plan.n_needed_slots - 1``, moved in one exchange: point to point when the group offers it
    (:func:`~hp_cp_core.collectives.slot_exchange_kind`), else one all-gather; and the next
    order token (Note [Backward order] in :mod:`hp_cp_core.collectives`). ``work()`` (may be
    ``None``) runs while the slots travel when ``overlap`` (Note [Overlapped exchanges]), else
    after the exchange."""
    if slot_exchange_kind(group) == "p2p":
        exchanged, token = exchange_compressed_slots(group, ops, owned, plan, token, work, overlap)
        return [slot_buffer(ops, t, plan.slot_exchange) for t in exchanged], token
    gathered, token = gather_compressed_slots(group, ops, owned, plan, token)
    if work is not None:
        work()
    return [select_and_pad_smallop(ops, g, plan) for g in gathered], token


def regather_compressed_kv(group: Group, ops: Backend, owned: Sequence[Any], plan: RankPlan):
    """What :func:`build_global_compressed_kv_for_cp` returned, again, from the same owned
    slots: the blocking exchange, no order token, counted as ``slot_exchange_regather``
    (point to point; an all-gather group gathers again). Run in backward, without autograd
    (Note [Re-gathered slots])."""
    if slot_exchange_kind(group) == "p2p":
        slots = regather_plan(plan)
        exchanged, _ = group.exchange_rows([(t, slots) for t in owned], None)
        return [slot_buffer(ops, t, plan.slot_exchange) for t in exchanged]
    gathered, _ = gather_compressed_slots(group, ops, owned, plan, None)
    return [select_and_pad_smallop(ops, g, plan) for g in gathered]


class RegatherSlotPlan(SlotExchangePlan):
    """The slot exchange's plan under the name of its re-run in backward (counters, desync
    report); the same arrays."""

    exchange_name = "slot_exchange_regather"


def regather_plan(plan: RankPlan) -> RegatherSlotPlan:
    """``plan.slot_exchange`` as a :class:`RegatherSlotPlan` (made once per plan)."""
    key = ("regather",)
    found = plan.column_work.get(key)
    if found is None:
        slots = plan.slot_exchange
        found = plan.column_work[key] = RegatherSlotPlan(
            **{f.name: getattr(slots, f.name) for f in dataclasses.fields(slots)}
        )
    return found


__all__ = [
    "RegatherSlotPlan",
    "build_global_compressed_kv_for_cp",
    "regather_compressed_kv",
    "regather_plan",
    "build_x_ext",
    "select_and_pad_smallop",
    "slot_buffer",
    "stage1_compress_with_halo",
]
