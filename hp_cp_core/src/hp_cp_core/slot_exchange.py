"""Which compressed slots travel to which rank, and where each lands in the reader's buffer.

Note [Causal-prefix slot exchange]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank computes the slots it owns (Note [Compressed slots and visibility] in
:mod:`hp_cp_core.indices`) and needs, besides them, exactly the slots one of its queries can
see. The visible slots of a rank are a union of causal prefixes, one per document its rows
touch, so the rank receives each such slot once, point to point from its owner, and nothing
else::

    load_balanced, cp = 2, r = 4, S = 32: chunks of 8 rows, 2 slots each

    slot    s0 s1 | s2 s3 | s4 s5 | s6 s7
    owner    0  0 |  1  1 |  1  1 |  0  0
    rank 0 holds rows 0-7 and 24-31: sees s0..s7, owns s0 s1 s6 s7 -> receives s2..s5
    rank 1 holds rows 8-23:           sees s0..s5, owns s2..s5       -> receives s0 s1

    rank 0's buffer: [s2 s3 s4 s5 | s0 s1 s6 s7 | 0]  --buffer_index [4 5 0 1 2 3 6 7]-->  s0..s7

The attention code indexes slots by global slot id, ``0 .. n_needed_slots - 1``. The received
slots (source-rank order, ascending within a source: what ``exchange_rows`` returns) and the
owned ones, followed by one zero row, are put in that order by ``buffer_index``; a slot below
``n_needed_slots`` that no local query sees (an earlier document held by other ranks, packed
input) points at the zero row. Such a slot can only be scored by a chunk of queries whose
range spans it, and the visibility mask drops it there, so the zero never reaches an output.
For a contiguous padded layout the received slots are already the prefix before the owned
ones, and ``buffer_index`` is ``None`` (the buffer is the first ``n_needed_slots`` rows).

Every rank plans every rank's visible slots (they decide what it sends), as ranges of slot
ids from the last row of each (run, document) pair: a query's visible range only grows along
its document, so that row's range covers the others'. A binary search maps the ranges onto
the positions of the (ascending) owned slots. The cost is O(documents + ranks) for the
ranges and O(slots) for the lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hp_cp_core.indices import compressed_visibility
from hp_cp_core.layout import Documents, SequenceLayout


@dataclass(frozen=True, eq=False)
class SlotExchangePlan:
    """The compressed slots one rank sends and receives point to point (an ``exchange_rows``
    plan, like :class:`~hp_cp_core.plan.HaloPlan`), and the buffer it builds from them.

    Attributes:
        send_rows: per destination rank, the rows of this rank's owned-slot tensor (positions
            in ``RankPlan.owned_slots``) that rank's queries can see, ascending.
        recv_counts: per source rank, how many slots arrive from it.
        recv_slots: global ids of the received slots, in arrival order (source rank, then
            ascending).
        buffer_index: per global slot ``0 .. n_buffer - 1``, its row in
            ``[received ; owned ; one zero row]``; ``None`` when that is the first ``n_buffer``
            rows of ``[received ; owned]``.
        n_buffer: slots in the global-order buffer (``RankPlan.n_needed_slots``).
        n_filler: buffer slots no local query sees (they read the zero row).
    """

    send_rows: tuple[np.ndarray, ...]
    recv_counts: tuple[int, ...]
    recv_slots: np.ndarray
    buffer_index: np.ndarray | None
    n_buffer: int
    n_filler: int
    exchange_name = "slot_exchange"

    @property
    def n_halo(self) -> int:
        """Slots received (the ``exchange_rows`` contract's name for the rows received)."""
        return int(self.recv_slots.size)

    @property
    def send_total(self) -> int:
        return int(sum(s.size for s in self.send_rows))


def visible_slot_ranges(
    layout: SequenceLayout, docs: Documents, compress_ratio: int, grid: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rank, start, stop)``: ranges of global slots whose union is what rank k's queries
    see, a few per rank (they may overlap).

    Per run of a rank, the last row of each document in it sees the union of what the
    document's rows in that run see (see Note [Causal-prefix slot exchange]).
    """
    cu = docs.cu_seqlens
    ranks, last_rows = [], []
    for rank in range(layout.cp_size):
        for a, b in layout.runs(rank):
            if b <= a:
                continue
            ends = cu[(cu > a) & (cu < b)] - 1  # documents ending inside the run
            rows = np.concatenate([ends, [b - 1]]).astype(np.int64)
            last_rows.append(rows)
            ranks.append(np.full(rows.size, rank, dtype=np.int64))
    if not last_rows:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    owner = np.concatenate(ranks)
    start, count = compressed_visibility(np.concatenate(last_rows), docs, compress_ratio, grid)
    seen = count > 0
    return owner[seen], start[seen], (start + count)[seen]


def _cover(starts: np.ndarray, stops: np.ndarray, size: int) -> np.ndarray:
    """``[size]`` bool: inside at least one ``[start, stop)`` (ranges may overlap)."""
    diff = np.bincount(starts, minlength=size + 1) - np.bincount(stops, minlength=size + 1)
    return np.cumsum(diff[:size]) > 0


def build_slot_exchange(
    owners: np.ndarray,
    ranges: tuple[np.ndarray, np.ndarray, np.ndarray],
    rank: int,
    cp_size: int,
    n_needed: int,
) -> SlotExchangePlan:
    """The point-to-point slot plan of ``rank`` (see Note [Causal-prefix slot exchange]).

    Args:
        owners: owner rank of every global slot.
        ranges: :func:`visible_slot_ranges` of every rank.
        rank: the planning rank.
        cp_size: ranks in the group.
        n_needed: global slots ``0 .. n_needed - 1`` ``rank``'s buffer holds.
    """
    owners = np.asarray(owners, dtype=np.int64)
    who, starts, stops = ranges
    owned = np.flatnonzero(owners == rank)
    send_rows = []
    for dst in range(cp_size):
        if dst == rank:
            send_rows.append(np.zeros(0, dtype=np.int64))
            continue
        # dst's ranges as positions in the owned slots (ascending ids): what dst sees of mine
        lo = np.searchsorted(owned, starts[who == dst])
        hi = np.searchsorted(owned, stops[who == dst])
        send_rows.append(np.flatnonzero(_cover(lo, hi, owned.size)).astype(np.int64))
    mine = who == rank
    seen = _cover(starts[mine], stops[mine], owners.size)
    wanted = np.flatnonzero(seen & (owners != rank))
    src = owners[wanted]
    recv_slots = wanted[np.argsort(src, kind="stable")]
    recv_counts = tuple(int(c) for c in np.bincount(src, minlength=cp_size))
    n_recv, n_owned = recv_slots.size, owned.size
    index = np.full(n_needed, n_recv + n_owned, dtype=np.int64)  # the zero row
    index[recv_slots] = np.arange(n_recv, dtype=np.int64)
    own = owned[owned < n_needed]
    index[own] = n_recv + np.arange(own.size, dtype=np.int64)
    n_filler = int((index == n_recv + n_owned).sum())
    identity = n_filler == 0 and np.array_equal(index, np.arange(n_needed))
    return SlotExchangePlan(
        send_rows=tuple(send_rows),
        recv_counts=recv_counts,
        recv_slots=recv_slots,
        buffer_index=None if identity else index,
        n_buffer=int(n_needed),
        n_filler=n_filler,
    )


__all__ = ["SlotExchangePlan", "build_slot_exchange", "visible_slot_ranges"]
