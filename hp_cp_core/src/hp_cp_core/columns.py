"""Column planning: which rows each local query attends, as numpy index arrays from the plan.

Backends and kernels execute these lists; they never derive them (one home for the math).

Note [Columns of a query]
~~~~~~~~~~~~~~~~~~~~~~~~~
The attention of local query t reads one *pool* ``[ori_ext ; cmp_kv]``: the window ext frame
(``n_ext`` rows) followed by the global compressed slots (slot j at pool row ``n_ext + j``).
In single-device order its columns are the window, then the compressed slots::

    pool rows   0 ........ n_ext-1 | n_ext + 0 .. n_ext + N-1
                [ window ext frame ] [ compressed slots       ]
    query t     ws[t] .. ws[t]+wl[t]-1, -1 pad to W | slots (HCA: start .. start+count-1,
                                                        CSA: the indexer's top-k of them)

* window: ``window_start`` / ``window_len`` of the plan, ascending, ``-1`` padded to W;
* HCA (r = 128): every visible slot ``cmp_start .. cmp_start + cmp_count - 1``, ascending;
* CSA (r = 4): the indexer scores a query chunk against the slot range its queries can see
  (:class:`ScoreChunk`: the union of their ranges plus a per-query visibility mask) and keeps
  ``min(topk, width)`` picks, ties to the lower slot, ``-1`` for invisible picks.

A dense kernel reads the window of a block of consecutive queries as one *band* of ext rows
(:class:`DenseBlock`): the union of their windows plus a mask of which key each query sees.
Blocks never straddle two contiguous runs (a load-balanced rank has two), so a band spans at
most ``block_rows + W - 1`` keys. HCA's visible slots are ranges too, so a block can also
read them as one band of slots (the union of its queries' visible ranges, masked)::

    block of queries lo .. hi-1        keys k0 .. k1           slots s0 .. s1 (HCA)
                                       x x x . .               s s .
                                       . x x x .               s s s
                                       . . x x x               s s s

The indexer's picks (CSA) are visible slots, so a block's picks lie in the same union of
visible ranges. Where that union is narrow (at most ``picks_band_max`` slots: the early
positions of a sequence, where a query sees few more slots than it picks), a kernel can read
the picks as that band too, masked to the picks at run time, instead of gathering
``[rows, topk, D]``; wider unions leave the band empty and the picks are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hp_cp_core.indices import compressed_index_dense, window_index_dense

if TYPE_CHECKING:
    from hp_cp_core.plan import RankPlan

__all__ = ["DenseBlock", "PlanColumns", "ScoreChunk", "select_topk_numpy"]


@dataclass(frozen=True, eq=False)
class ScoreChunk:
    """Local queries ``[lo, hi)`` scored against global slots ``[slot_start, slot_stop)``.

    Attributes:
        lo, hi: the local queries (inside one contiguous run).
        slot_start, slot_stop: the union of their visible slot ranges.
        visible: ``[hi - lo, slot_stop - slot_start]``, True where the query sees the slot.
    """

    lo: int
    hi: int
    slot_start: int
    slot_stop: int
    visible: np.ndarray

    def keep(self, topk: int) -> int:
        """Picks a top-k over this chunk returns: ``min(topk, slots scored)``."""
        return min(int(topk), self.slot_stop - self.slot_start)


@dataclass(frozen=True, eq=False)
class DenseBlock:
    """Local queries ``[lo, hi)`` with their window as one dense band of ext rows and, for
    HCA, their visible slots as one dense band of global slots.

    Attributes:
        lo, hi: the local queries (inside one contiguous run).
        key_start, key_stop: the band ``[key_start, key_stop)`` of window ext-frame rows.
        mask: ``[hi - lo, key_stop - key_start]``, True where the key is in the query's window.
        slot_start, slot_stop: the band of global slots (an empty range when not asked for).
        slot_mask: ``[hi - lo, slot_stop - slot_start]``, True where the query sees the slot;
            ``None`` when slots were not asked for or no query of the block sees one.
        picks_in_band: True when the block's indexer picks are to be read as the slot band
            ``[slot_start, slot_stop)`` (masked to the picks by the kernel) instead of being
            gathered; ``slot_mask`` is then ``None``.
    """

    lo: int
    hi: int
    key_start: int
    key_stop: int
    mask: np.ndarray
    slot_start: int = 0
    slot_stop: int = 0
    slot_mask: np.ndarray | None = None
    picks_in_band: bool = False


class PlanColumns:
    """The columns of a rank's local queries (Note [Columns of a query]).

    Args:
        plan: the rank's :class:`hp_cp_core.plan.RankPlan`.
        n_ext: rows of the window ext frame (pool rows of compressed slots start there).
    """

    def __init__(self, plan: RankPlan, n_ext: int) -> None:
        self.plan = plan
        self.n_ext = int(n_ext)
        self.window_size = int(plan.spec.window_size)

    @property
    def n_local(self) -> int:
        return self.plan.n_local

    def chunks(self, query_chunk: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` ranges of at most ``query_chunk`` local queries, in local order."""
        n, step = self.n_local, max(int(query_chunk), 1)
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def run_chunks(self, query_chunk: int) -> list[tuple[int, int]]:
        """Like :meth:`chunks`, but no range straddles two contiguous runs."""
        step = max(int(query_chunk), 1)
        out = []
        for a, b, _ in self.plan.runs:
            out.extend((lo, min(lo + step, b)) for lo in range(a, b, step))
        return out

    def window(self, lo: int, hi: int) -> np.ndarray:
        """``[hi - lo, W]`` window ext rows (= pool rows), ascending, ``-1`` padded."""
        p = self.plan
        return window_index_dense(p.window_start[lo:hi], p.window_len[lo:hi], self.window_size)

    def visible_slots(self, lo: int, hi: int) -> np.ndarray:
        """``[hi - lo, width]`` every visible global slot (HCA order), ``-1`` padded; width is
        the chunk's largest visible count."""
        count = self.plan.cmp_count[lo:hi]
        width = int(count.max()) if count.size else 0
        return compressed_index_dense(self.plan.cmp_start[lo:hi], count, width)

    def pool_rows(self, slots: np.ndarray) -> np.ndarray:
        """Global slot ids (``-1`` = none) as pool rows ``n_ext + slot``."""
        return np.where(slots >= 0, slots + self.n_ext, -1)

    def visibility(self, lo: int, hi: int, slot_start: int, slot_stop: int) -> np.ndarray:
        """``[hi - lo, slot_stop - slot_start]``: True where query ``lo + i`` sees the slot."""
        start = self.plan.cmp_start[lo:hi, None]
        stop = start + self.plan.cmp_count[lo:hi, None]
        cand = np.arange(slot_start, slot_stop, dtype=np.int64)[None, :]
        return (cand >= start) & (cand < stop)

    def score_chunks(self, query_chunk: int) -> list[ScoreChunk]:
        """The indexer's scoring work: per chunk of at most ``query_chunk`` queries (inside one
        run), the slot range its queries see. Chunks whose queries see no slot are left out
        (their picks are all ``-1``). Built once per plan and query chunk."""
        key = ("score", int(query_chunk))
        if key not in self.plan.column_work:
            self.plan.column_work[key] = self._score_chunks(query_chunk)
        return self.plan.column_work[key]

    def _score_chunks(self, query_chunk: int) -> list[ScoreChunk]:
        start = self.plan.cmp_start
        stop = start + self.plan.cmp_count
        out = []
        for lo, hi in self.run_chunks(query_chunk):
            seen = stop[lo:hi] > start[lo:hi]  # a query that sees nothing may start anywhere
            if not seen.any():
                continue
            s0, s1 = int(start[lo:hi][seen].min()), int(stop[lo:hi][seen].max())
            out.append(ScoreChunk(lo, hi, s0, s1, self.visibility(lo, hi, s0, s1)))
        return out

    def dense_blocks(
        self, block_rows: int, *, with_slots: bool = False, picks_band_max: int = 0
    ) -> list[DenseBlock]:
        """Every local query once, in blocks of at most ``block_rows`` queries: the block's
        window band and, with ``with_slots`` (HCA), its band of visible slots, or, with
        ``picks_band_max > 0`` (CSA), the band its indexer picks lie in when that band is at
        most ``picks_band_max`` slots wide (``picks_in_band``). Built once per plan and
        arguments."""
        if with_slots and picks_band_max:
            raise ValueError("with_slots (HCA) and picks_band_max (CSA) exclude each other")
        key = ("dense", int(block_rows), bool(with_slots), int(picks_band_max))
        if key not in self.plan.column_work:
            self.plan.column_work[key] = self._dense_blocks(block_rows, with_slots, picks_band_max)
        return self.plan.column_work[key]

    def _dense_blocks(
        self, block_rows: int, with_slots: bool, picks_band_max: int
    ) -> list[DenseBlock]:
        p = self.plan
        first = p.window_start
        stop = p.window_start + p.window_len
        slot_stop = p.cmp_start + p.cmp_count
        out = []
        for lo, hi in self.run_chunks(block_rows):
            k0, k1 = int(first[lo:hi].min()), int(stop[lo:hi].max())
            keys = np.arange(k0, k1, dtype=np.int64)[None, :]
            mask = (keys >= first[lo:hi, None]) & (keys < stop[lo:hi, None])
            seen = p.cmp_count[lo:hi] > 0  # a query that sees nothing may start anywhere
            if not (with_slots or picks_band_max) or not seen.any():
                out.append(DenseBlock(lo, hi, k0, k1, mask))
                continue
            s0, s1 = int(p.cmp_start[lo:hi][seen].min()), int(slot_stop[lo:hi][seen].max())
            if with_slots:
                visible = self.visibility(lo, hi, s0, s1)
                out.append(DenseBlock(lo, hi, k0, k1, mask, s0, s1, visible))
            elif s1 - s0 <= picks_band_max:
                out.append(DenseBlock(lo, hi, k0, k1, mask, s0, s1, picks_in_band=True))
            else:
                out.append(DenseBlock(lo, hi, k0, k1, mask))
        return out


def select_topk_numpy(scores: np.ndarray, chunk: ScoreChunk, topk: int) -> np.ndarray:
    """The indexer's picks from host scores ``[B, hi - lo, slot_stop - slot_start]``: global
    slot ids ``[B, hi - lo, topk]``, descending score, ties to the lower slot, ``-1`` where the
    pick is invisible or missing."""
    scores = np.where(chunk.visible[None], scores, -np.inf)
    k = chunk.keep(topk)
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    best = np.take_along_axis(scores, order, axis=-1)
    picks = np.where(np.isneginf(best), -1, order + chunk.slot_start)
    pad = [(0, 0)] * (picks.ndim - 1) + [(0, int(topk) - k)]
    return np.pad(picks, pad, constant_values=-1)
