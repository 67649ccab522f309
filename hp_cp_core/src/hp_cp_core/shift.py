"""Shifting a sharded sequence by whole rows (multi-token prediction's next-token inputs).

Note [Shifting rows across ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Multi-token prediction (MTP) feeds row ``i`` the token of row ``i + 1``: the sequence moves
up by one row and a zero enters at the end (mindformers' ``roll_tensor(t, shifts=-1)``). On
one device that is a slice. Under CP, the last row of each chunk needs the first row of the
next chunk, and another rank may hold that chunk::

    S = 8, cp = 2, load-balanced    chunks   c0 = 0 1 | c1 = 2 3 | c2 = 4 5 | c3 = 6 7
    rank 0 holds c0 c3: 0 1 6 7     gets     1 [2] 7 (0)     [2]: c1's first row, rank 1
    rank 1 holds c1 c2: 2 3 4 5     gets     3  4  5 [6]     [6]: c3's first row, rank 0
                                                             (0): past the end, a zero

Each rank sends the ``|shift|`` rows at the edge of each of its chunks (the first ones for a
shift up, the last ones for a shift down) in one all-gather of ``cp * chunks * |shift|``
rows; every other row is one of its own. :class:`ShiftPlan` says which rows to send and,
for each output row, where it comes from in ``[own rows | gathered edges | a zero row]``.
``|shift|`` may not exceed a chunk (MTP shifts by one, again for each MTP layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hp_cp_core.errors import PlanError
from hp_cp_core.layout import SequenceLayout

__all__ = ["ShiftPlan", "shift_plan"]


@dataclass(frozen=True, eq=False)
class ShiftPlan:
    """How one rank computes its rows of ``out[g] = x[g - shift]`` (zero outside the sequence).

    Attributes:
        shift: rows to move by (mindformers' ``shifts``: negative moves rows up).
        send: ``[edges]`` int64, this rank's local rows that go into the all-gather, the same
            count on every rank; empty when no row crosses a rank.
        take: ``[local rows]`` int64 index into the concatenation of this rank's rows (``0 ..
            L - 1``), the gathered edges (``L ..``, rank-major) and one zero row (the last).
    """

    shift: int
    send: np.ndarray
    take: np.ndarray

    @property
    def needs_exchange(self) -> bool:
        """Whether any output row comes from another rank (the same on every rank)."""
        return self.send.size > 0


def shift_plan(layout: SequenceLayout, rank: int, shift: int) -> ShiftPlan:
    """The plan of ``rank`` for shifting the sequence laid out as ``layout`` by ``shift`` rows.

    Raises:
        PlanError: ``|shift|`` is larger than a chunk of the layout.
    """
    shift, c = int(shift), layout.chunk_rows
    n_local = layout.local_rows_per_rank
    if abs(shift) > c and layout.cp_size > 1:
        raise PlanError(
            f"a shift of {shift} rows crosses more than one chunk of {c} rows ({layout.kind}, "
            f"cp = {layout.cp_size}, {layout.total_rows} rows); shift by at most {c} rows at "
            "a time."
        )
    mine = layout.rank_rows(rank)
    source = mine - shift
    outside = (source < 0) | (source >= layout.total_rows)
    source = np.clip(source, 0, max(layout.total_rows - 1, 0))
    k = abs(shift)
    if shift == 0 or layout.cp_size == 1:
        take = np.where(outside, n_local, layout.local_index(source))
        return ShiftPlan(shift, np.zeros(0, np.int64), take.astype(np.int64))
    # the edge rows of each chunk, in the owner's local order: first k (shift up), last k
    per_chunk = np.arange(k) if shift < 0 else np.arange(c - k, c)
    n_chunks = len(layout.chunks_of(rank))
    send = (np.arange(n_chunks)[:, None] * c + per_chunk[None, :]).reshape(-1)
    owner = layout.rank_of(source)
    at = layout.local_index(source)
    # position of an edge row among its owner's sent rows
    slot = (at // c) * k + (at % c) - (0 if shift < 0 else c - k)
    remote = n_local + owner * send.size + slot
    zero = n_local + layout.cp_size * send.size
    take = np.where(outside, zero, np.where(owner == rank, at, remote))
    return ShiftPlan(shift, send.astype(np.int64), take.astype(np.int64))
