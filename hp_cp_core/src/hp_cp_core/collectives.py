"""The exchanges of one layer, written against the :class:`~hp_cp_core.backend.Group` protocol.

One point-to-point message per peer carries the window KV halo and the x halo together
(Note [Halos and the ext frame] in :mod:`hp_cp_core.plan`). The main and indexer compressed
slots travel together too: point to point, each rank receiving only the slots its queries see
(Note [Causal-prefix slot exchange] in :mod:`hp_cp_core.slot_exchange`), when the group
declares ``point_to_point``; else by one all-gather of every rank's slots.

Note [Backward order]
~~~~~~~~~~~~~~~~~~~~~
A collective returns only when every rank of the group has entered it, so every rank must
run the same backward collectives in the same order. Autograd promises no order between
nodes that do not depend on each other. On a rank that owns no compressed slot (L < r), the
halo exchange and the slot exchange are independent in its graph and the engine may run
the halo's backward first, while on its peers the compressor reads the halo, so the
slot exchange's backward must come first there: each rank then waits in a different collective,
forever. Which order a rank picks depends on the user's module, not on us.

So the order is made a data dependence. Each layer forward threads one *order token* through
its exchanges (``Group.begin_order`` / each exchange / ``Group.end_order``):

    x --begin_order--> t0 --exchange_rows--> t1 --exchange_rows--> t2 --end_order--> out
                          (window KV, x halo)   (compressed slots; all_gather_rows
                                                  on a group without point-to-point)

An exchange's backward needs the gradient of the token it returned, which only the next
exchange's backward (``end_order``'s for the last one) produces:

    out.grad -> end_order -> t2.grad -> slot bwd -> t1.grad -> halo bwd -> t0.grad -> x

so every rank runs them last to first, whatever its module computes, and a rank that never
used an exchange's output still runs its backward (the token keeps it in the graph). Between
layers: ``begin_order`` gives the layer input ``x`` a zero gradient that only exists after the
layer's first exchange ran backward, and the layer below produced ``x``, so the layer below
starts its backward exchanges only after this layer finished all of its own. This holds for
layers applied one after the other (a decoder stack), on every rank whose loss depends on the
layer output; a rank that skips a layer's backward is a bug the desync report names.

Note [Overlapped exchanges]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A group that offers ``issue_rows`` / ``wait_rows`` splits each exchange in two: issue (the
messages leave, receives are posted) and wait (at the first consumer). The layer's local work
that needs no received row runs in between (``CPForward(local_work=...)``: the
query projections while the halo travels, the indexer queries while the slots travel)::

    forward   issue halo -- q projections -- wait halo -- compress -- issue slots
                                                       -- indexer queries -- wait slots -- attn
    backward  (mirror) wait's backward issues the gradients' messages, the work's
              backward runs, issue's backward waits for them

The token runs through both halves (``t -> issue -> t' -> wait -> t''``), so backward still
runs every exchange's issue and wait in one order on every rank (Note [Backward order]);
only one exchange of a layer is in flight at a time.

A backend implements tokens with its framework's autograd (an empty tensor in the graph,
see ``hp_cp_torch``). A framework whose backward is the forward program reversed (JAX's
transpose) already has a fixed order; its tokens can be placeholders passed through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hp_cp_core.backend import Backend, Group
from hp_cp_core.plan import RankPlan


def overlaps(group: Group, overlap: bool) -> bool:
    """Whether exchanges on ``group`` are split into issue and wait (Note [Overlapped
    exchanges]): asked for, and the group offers ``issue_rows`` / ``wait_rows``."""
    return bool(overlap) and hasattr(group, "issue_rows") and hasattr(group, "wait_rows")


def exchange_rows_around(
    group: Group, items: Sequence[tuple[Any, Any]], token: Any, work: Any, overlap: bool
) -> tuple[list[Any], Any]:
    """``group.exchange_rows(items, token)`` with ``work()`` (local work that needs none of
    its rows; may be ``None``) run while the messages travel when ``overlap``, else after."""
    if overlaps(group, overlap):
        pending, token = group.issue_rows(items, token)
        if work is not None:
            work()
        return group.wait_rows(pending, token)
    outs, token = group.exchange_rows(items, token)
    if work is not None:
        work()
    return outs, token


def exchange_halos(
    group: Group,
    ops: Backend,
    ori_kv: Any,
    x: Any,
    plan: RankPlan,
    token: Any,
    work: Any = None,
    overlap: bool = False,
) -> tuple[Any, Any, Any]:
    """Window KV halo and x halo in one exchange (``work()`` in between when ``overlap``).

    Returns ``(ori_ext, halo_x, token)``: the window KV in the ext frame (``[halo ; local]``
    for a contiguous layout), the received x rows in ascending global order (``None`` for
    r = 0) and the next order token (Note [Backward order]).
    """
    items = [(ori_kv, plan.window)]
    if plan.x is not None:
        items.append((x, plan.x))
    outs, token = exchange_rows_around(group, items, token, work, overlap)
    ori_ext = outs[0]
    if plan.window.ext_from_recv is not None:
        ori_ext = ops.index_rows(ori_ext, plan.window.ext_from_recv)
    halo_x = None
    if plan.x is not None:
        halo_x = ops.narrow(outs[1], 0, plan.x.n_halo)
        if plan.x.halo_gather is not None:
            halo_x = ops.index_rows(halo_x, plan.x.halo_gather)
    return ori_ext, halo_x, token


def slot_exchange_kind(group: Group) -> str:
    """How compressed slots travel on ``group``: ``"p2p"`` when it declares
    ``point_to_point = True`` (its ``exchange_rows`` moves only the rows asked for), else
    ``"all_gather"`` (the fallback every group supports)."""
    return "p2p" if getattr(group, "point_to_point", False) else "all_gather"


def exchange_compressed_slots(
    group: Group,
    ops: Backend,
    owned: Sequence[Any],
    plan: RankPlan,
    token: Any,
    work: Any = None,
    overlap: bool = False,
) -> tuple[list[Any], Any]:
    """Every rank's owned slots of several compressors, point to point in one message per
    peer, each rank receiving only the slots its queries see.

    Returns, per input, ``[received (source-rank order) ; owned]``, and the next order
    token; see :func:`~hp_cp_core.compression.slot_buffer` for putting it in global order.
    """
    items = [(t, plan.slot_exchange) for t in owned]
    return exchange_rows_around(group, items, token, work, overlap)


def gather_compressed_slots(
    group: Group, ops: Backend, owned: Sequence[Any], plan: RankPlan, token: Any
) -> tuple[list[Any], Any]:
    """All-gather every rank's owned slots of several compressors in one collective.

    Returns, per input, the rank-major padded buffer ``[cp * cap, (batch,) d]``, and the next
    order token; see
    :func:`~hp_cp_core.compression.select_and_pad_smallop` for putting it in global order.
    """
    flats = [ops.flatten_rows(t) for t in owned]
    widths = [ops.shape(f)[1] for f in flats]
    packed = ops.pad_rows(ops.cat_features(flats), plan.gather_cap)
    gathered, token = group.all_gather_rows(packed, token)
    parts = ops.split_features(gathered, widths)
    return [
        ops.unflatten_rows(p, (ops.shape(p)[0], *ops.shape(t)[1:])) for p, t in zip(parts, owned)
    ], token
