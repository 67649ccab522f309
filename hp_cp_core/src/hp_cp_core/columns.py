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

Note [Readers of a band]
~~~~~~~~~~~~~~~~~~~~~~~~
A backward that owns pool rows (no atomics) needs the inverse: for pool row r, which queries
read it, at which column. The window and HCA's slots are *bands*: query t reads rows
``start[t] .. start[t] + length[t] - 1`` at consecutive columns. Inside one contiguous run
``start`` and ``start + length`` never decrease (over the queries that read anything), so
the readers of r are one range of queries per run, found by two binary searches, and the
column is ``col0 + r - start[t]``. Only the indexer's picks are data dependent (a kernel
inverts those on the device)::

    query t   start  length   rows read (W = 3)      readers of row r = 2:
      0         0      1      0                      a = first t with start + length > 2
      1         0      2      0 1                      = 2
      2         0      3      0 1 2                  b = first t with start > 2
      3         1      3        1 2 3                  = 5
      4         2      3          2 3 4              readers 2 .. 4, at columns 2 - start[t]

A range may hold queries that read nothing (``length = 0``); a kernel keeps only the
queries with ``start <= r < start + length``.

Note [Masks on demand]
~~~~~~~~~~~~~~~~~~~~~~
A plan is cached and lives as long as its ``enable_cp`` handle, so what it keeps must grow
with the rank's rows only. A mask per query chunk (which slots each query sees) is
``[rows, S / r]`` booleans; over every chunk of a rank that is ``L * S / r`` bytes (32 GiB
at S = 1M, cp = 8, for the indexer's chunks alone). So :class:`ScoreChunk` and
:class:`DenseBlock` keep each query's range ``[first, stop)`` (views of the plan's arrays,
O(L) in all) and build a mask when it is read; a kernel reads one block's mask, uses it and
drops it. Likewise the indexer's scores of one chunk are ``[rows, S / r]`` per head:
:meth:`PlanColumns.score_chunk_rows` bounds the chunk's rows so that a chunk scores at most
``max_cells`` (query, slot) pairs, whatever S is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hp_cp_core.indices import compressed_index_dense, window_index_dense

if TYPE_CHECKING:
    from hp_cp_core.plan import RankPlan

__all__ = [
    "ColumnBands",
    "DenseBlock",
    "PlanColumns",
    "ScoreChunk",
    "TopkRow",
    "band_readers",
    "select_topk_numpy",
    "select_two_level_numpy",
]


def _range_mask(first: np.ndarray, stop: np.ndarray, start: int, end: int) -> np.ndarray:
    """``[n, end - start]``: True where column ``start + j`` lies in ``[first[i], stop[i])``."""
    cand = np.arange(start, end, dtype=np.int64)[None, :]
    return (cand >= first[:, None]) & (cand < stop[:, None])


@dataclass(frozen=True, eq=False)
class ScoreChunk:
    """Local queries ``[lo, hi)`` scored against global slots ``[slot_start, slot_stop)``.

    The chunk keeps its queries' visible ranges (views of the plan's arrays), not the mask:
    a mask per chunk, kept for every chunk, would be ``[L, S / r]`` booleans per rank (Note
    [Masks on demand]).

    Attributes:
        lo, hi: the local queries (inside one contiguous run).
        slot_start, slot_stop: the union of their visible slot ranges.
        first, stop: ``[hi - lo]`` each query's visible slots ``[first, stop)``.
    """

    lo: int
    hi: int
    slot_start: int
    slot_stop: int
    first: np.ndarray
    stop: np.ndarray

    @property
    def visible(self) -> np.ndarray:
        """``[hi - lo, slot_stop - slot_start]``, True where the query sees the slot (built
        on every access: use it and drop it)."""
        return _range_mask(self.first, self.stop, self.slot_start, self.slot_stop)

    def keep(self, topk: int) -> int:
        """Picks a top-k over this chunk returns: ``min(topk, slots scored)``."""
        return min(int(topk), self.slot_stop - self.slot_start)


@dataclass(frozen=True)
class TopkRow:
    """Local queries ``[lo, hi)`` whose top-k row on one process is the global slots
    ``[start, start + length)`` (Note [The one-process top-k row]).

    Attributes:
        lo, hi: the local queries (inside one chunk and one document).
        start: global slot id of the row's first entry.
        length: entries of the row: the document's slots on one process.
    """

    lo: int
    hi: int
    start: int
    length: int

    def keep(self, topk: int) -> int:
        """Picks a top-k over the row returns: ``min(topk, length)``."""
        return max(min(int(topk), self.length), 0)


@dataclass(frozen=True, eq=False)
class DenseBlock:
    """Local queries ``[lo, hi)`` with their window as one dense band of ext rows and, for
    HCA, their visible slots as one dense band of global slots.

    The masks are built on access from the queries' ranges (views of the plan's arrays), so
    a plan holds no ``[L, band]`` array (Note [Masks on demand]).

    Attributes:
        lo, hi: the local queries (inside one contiguous run).
        key_start, key_stop: the band ``[key_start, key_stop)`` of window ext-frame rows.
        key_first, key_end: ``[hi - lo]`` each query's window ``[key_first, key_end)``.
        slot_start, slot_stop: the band of global slots (an empty range when not asked for).
        slot_first, slot_end: ``[hi - lo]`` each query's visible slots, when the block has a
            slot mask (HCA, some query of the block sees a slot); else ``None``.
        picks_in_band: True when the block's indexer picks are to be read as the slot band
            ``[slot_start, slot_stop)`` (masked to the picks by the kernel) instead of being
            gathered; there is then no slot mask.
    """

    lo: int
    hi: int
    key_start: int
    key_stop: int
    key_first: np.ndarray
    key_end: np.ndarray
    slot_start: int = 0
    slot_stop: int = 0
    slot_first: np.ndarray | None = None
    slot_end: np.ndarray | None = None
    picks_in_band: bool = False

    @property
    def mask(self) -> np.ndarray:
        """``[hi - lo, key_stop - key_start]``, True where the key is in the query's window."""
        return _range_mask(self.key_first, self.key_end, self.key_start, self.key_stop)

    @property
    def slot_mask(self) -> np.ndarray | None:
        """``[hi - lo, slot_stop - slot_start]``, True where the query sees the slot; ``None``
        when slots were not asked for, no query of the block sees one, or the picks are read
        as the band."""
        if self.slot_first is None or self.slot_end is None:
            return None
        return _range_mask(self.slot_first, self.slot_end, self.slot_start, self.slot_stop)


@dataclass(frozen=True, eq=False)
class ColumnBands:
    """The plan-derived columns of a query chunk, as bands, with their readers per pool row
    (Note [Readers of a band]): an atomics-free backward sums each pool row's gradient from
    these instead of inverting the columns by a sort.

    Band ``j`` is columns ``col0[j] ..`` of the chunk's queries: query ``i`` reads pool rows
    ``start[j, i] .. start[j, i] + length[j, i] - 1`` at columns ``col0[j] ..`` (the window:
    ``col0 = 0``; HCA's visible slots: ``col0 = W``).

    Attributes:
        col0: ``[NB]`` first column of each band.
        start, length: ``[NB, n]`` per chunk query (0-based in the chunk).
        first, stop: ``[NB, NR, P]``: per band, per contiguous run of the chunk and per pool
            row ``r``, the chunk queries ``first .. stop - 1`` include every query of the run
            that reads ``r`` in the band (a superset: a kernel keeps the queries with
            ``start <= r < start + length``); ``first == stop`` where none does.
        n_columns: columns ``0 .. n_columns - 1`` are covered by the bands; the later ones
            (the indexer's picks) are not.
    """

    col0: np.ndarray
    start: np.ndarray
    length: np.ndarray
    first: np.ndarray
    stop: np.ndarray
    n_columns: int


def band_readers(
    start: np.ndarray, length: np.ndarray, runs: list[tuple[int, int]], n_rows: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Per run and pool row, the query range ``[first, stop)`` that holds every query of the
    run reading the row (Note [Readers of a band]); ``None`` when some run's bands are not
    monotone (then they are not ranges: invert them by sorting instead).

    Args:
        start, length: ``[n]`` first pool row and row count of each query's band.
        runs: ``(lo, hi)`` query ranges in which ``start`` and ``start + length`` of the
            queries with ``length > 0`` never decrease.
        n_rows: pool rows.

    Returns:
        ``(first, stop)``, each ``[len(runs), n_rows]`` int64.
    """
    start = np.asarray(start, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    rows = np.arange(int(n_rows), dtype=np.int64)
    first = np.zeros((len(runs), rows.size), dtype=np.int64)
    stop = np.zeros_like(first)
    for j, (lo, hi) in enumerate(runs):
        reads = lo + np.flatnonzero(length[lo:hi] > 0)
        if not reads.size:
            continue
        s, e = start[reads], start[reads] + length[reads]
        if (np.diff(s) < 0).any() or (np.diff(e) < 0).any():
            return None
        a = np.searchsorted(e, rows, side="right")  # the first query whose band ends past r
        b = np.searchsorted(s, rows, side="right")  # the first query whose band starts past r
        some = b > a
        first[j] = np.where(some, reads[np.minimum(a, reads.size - 1)], 0)
        stop[j] = np.where(some, reads[np.maximum(b - 1, 0)] + 1, 0)
    return first, stop


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

    def block_visibility(self, lo: int, hi: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The two-level indexer's candidate blocks of queries ``lo:hi`` (Note [Two-level
        selection]): ``(first_slot, n_blocks)``, each ``[hi - lo]``; block c of query i holds
        the visible slots ``first_slot[i] + c*block .. min(+block, visible end) - 1``."""
        b = max(int(block), 1)
        count = self.plan.cmp_count[lo:hi]
        return self.plan.cmp_start[lo:hi].copy(), -(-count // b)

    def pool_rows(self, slots: np.ndarray) -> np.ndarray:
        """Global slot ids (``-1`` = none) as pool rows ``n_ext + slot``."""
        return np.where(slots >= 0, slots + self.n_ext, -1)

    def visibility(self, lo: int, hi: int, slot_start: int, slot_stop: int) -> np.ndarray:
        """``[hi - lo, slot_stop - slot_start]``: True where query ``lo + i`` sees the slot."""
        start = self.plan.cmp_start[lo:hi, None]
        stop = start + self.plan.cmp_count[lo:hi, None]
        cand = np.arange(slot_start, slot_stop, dtype=np.int64)[None, :]
        return (cand >= start) & (cand < stop)

    def column_bands(
        self, lo: int, hi: int, n_pool: int, *, with_slots: bool = False
    ) -> ColumnBands | None:
        """The window (and, with ``with_slots``, HCA's visible slots) of queries ``lo:hi``
        as :class:`ColumnBands` over a pool of ``n_pool`` rows (window ext rows, then the
        slots at ``n_ext``), in the column order of :meth:`window` then
        :meth:`visible_slots`; ``None`` if a band is not monotone in a run. Built once per
        plan and arguments."""
        key = ("bands", int(lo), int(hi), int(n_pool), bool(with_slots))
        if key not in self.plan.column_work:
            self.plan.column_work[key] = self._column_bands(lo, hi, n_pool, with_slots)
        return self.plan.column_work[key]

    def _column_bands(self, lo: int, hi: int, n_pool: int, with_slots: bool) -> ColumnBands | None:
        p = self.plan
        runs = [(max(a, lo) - lo, min(b, hi) - lo) for a, b, _ in p.runs if min(b, hi) > max(a, lo)]
        starts = [p.window_start[lo:hi]]
        lengths = [p.window_len[lo:hi]]
        col0 = [0]
        n_columns = self.window_size
        if with_slots:
            count = p.cmp_count[lo:hi]
            starts.append(p.cmp_start[lo:hi] + self.n_ext)
            lengths.append(count)
            col0.append(self.window_size)
            n_columns += int(count.max()) if count.size else 0
        readers = [band_readers(s, n, runs, n_pool) for s, n in zip(starts, lengths)]
        if any(r is None for r in readers):
            return None
        return ColumnBands(
            col0=np.asarray(col0, dtype=np.int64),
            start=np.stack([np.asarray(s, dtype=np.int64) for s in starts]),
            length=np.stack([np.asarray(n, dtype=np.int64) for n in lengths]),
            first=np.stack([r[0] for r in readers]),
            stop=np.stack([r[1] for r in readers]),
            n_columns=n_columns,
        )

    def score_chunk_rows(self, query_chunk: int, max_cells: int) -> int:
        """Rows per indexer scoring chunk: at most ``query_chunk``, and few enough that a
        chunk's scores ``[rows, slots]`` hold at most ``max_cells`` entries (at least one
        row; Note [Masks on demand]). Picks do not depend on it: each query's top-k is
        taken over its own visible slots."""
        slots = max(int(self.plan.n_needed_slots), 1)
        return max(1, min(int(query_chunk), int(max_cells) // slots))

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
            out.append(ScoreChunk(lo, hi, s0, s1, start[lo:hi], stop[lo:hi]))
        return out

    def topk_rows(
        self,
        lo: int,
        hi: int,
        sequence_rows: int | None = None,
        *,
        packed_row: str = "document",
        cu_seqlens: np.ndarray | None = None,
    ) -> list[TopkRow]:
        """Note [The one-process top-k row]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A model on one process scores each query against *every* compressed slot of its
        sequence, sets the invisible ones to ``-inf`` and calls its framework's top-k on
        that row. Where scores tie exactly (the ReLU scores of an indexer are 0 for every
        slot no head likes, so ties at 0 are common once top-k is well below the visible
        slots), which tied slots that top-k keeps depends on the whole row: its length and
        where the ``-inf`` entries sit. Scoring only the visible range under CP is then a
        different row, and can keep other tied slots. So an integration whose model selects
        that way rebuilds the row one process scores, per query::

            one process (S real rows, r = 4)    slots 0 .............. S // r - 1
            query t sees                        0 .. (t + 1) // r - 1 | -inf ...... -inf
            under CP: the chunk's scores        [slot_start, slot_stop) placed at their
                                                slots, -inf elsewhere, same length

        and calls the same top-k on it, with ``k = min(topk, length)``. Padded, the row is
        the slots of the real rows (``sequence_rows // r``; slots the layout's padding made
        are not in it). Packed, it depends on what the model does on one process:
        ``packed_row="document"`` when each document runs alone (the row is the document's
        own slots), ``"stream"`` when one row holds the slots of every real document of the
        packed stream (the document's own range visible, the rest ``-inf``).

        Args:
            lo, hi: local queries inside one contiguous run.
            sequence_rows: global rows before the padding ``handle.shard(..., pad_value=)``
                appended (``None``: every row is real).
            packed_row: ``"document"`` or ``"stream"`` (packed only).
            cu_seqlens: the global packed boundaries (``call.cu_seqlens``); with
                ``"stream"``, the documents after ``sequence_rows`` (the padding) are left
                out of the row.

        Returns:
            The queries ``lo:hi`` cut where the row changes (a document starts), in order.
        """
        if packed_row not in ("document", "stream"):
            raise ValueError(f"packed_row must be 'document' or 'stream', got {packed_row!r}")
        cu = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64)
        key = ("topk_rows", int(lo), int(hi), sequence_rows, packed_row)
        key += (None if cu is None else cu.tobytes(),)
        if key not in self.plan.column_work:  # once per plan, chunk and sequence
            self.plan.column_work[key] = self._topk_rows(lo, hi, sequence_rows, packed_row, cu)
        return self.plan.column_work[key]

    def _topk_rows(
        self,
        lo: int,
        hi: int,
        sequence_rows: int | None,
        packed_row: str,
        cu_seqlens: np.ndarray | None,
    ) -> list[TopkRow]:
        p = self.plan
        r = int(p.spec.compress_ratio)
        cmp_cu = p.cmp_cu_seqlens
        out = []
        for run in p.document_runs:
            a, b = max(run.local_start, lo), min(run.local_stop, hi)
            if b <= a:
                continue
            if cmp_cu is not None and packed_row == "document":
                start = int(cmp_cu[run.doc])
                length = int(cmp_cu[run.doc + 1]) - start
            elif cmp_cu is not None:
                real_docs = cmp_cu.size - 1
                if sequence_rows is not None and cu_seqlens is not None:
                    ends = np.asarray(cu_seqlens, dtype=np.int64)[1:]
                    real_docs = int(np.searchsorted(ends, int(sequence_rows), side="right"))
                start, length = 0, int(cmp_cu[real_docs])
            else:
                rows = p.n_slots_total * r if sequence_rows is None else int(sequence_rows)
                start, length = 0, min(rows // r, p.n_slots_total) if r else 0
            out.append(TopkRow(a, b, start, length))
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
            window = (lo, hi, k0, k1, first[lo:hi], stop[lo:hi])
            seen = p.cmp_count[lo:hi] > 0  # a query that sees nothing may start anywhere
            if not (with_slots or picks_band_max) or not seen.any():
                out.append(DenseBlock(*window))
                continue
            s0, s1 = int(p.cmp_start[lo:hi][seen].min()), int(slot_stop[lo:hi][seen].max())
            if with_slots:
                ranges = (p.cmp_start[lo:hi], slot_stop[lo:hi])
                out.append(DenseBlock(*window, s0, s1, *ranges))
            elif s1 - s0 <= picks_band_max:
                out.append(DenseBlock(*window, s0, s1, picks_in_band=True))
            else:
                out.append(DenseBlock(*window))
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


# Note [Two-level selection]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A two-level indexer (``LayerSpec.index_block = b``) cuts a query's visible slots (one
# contiguous range of the global slot buffer, Note [Compressed slots and visibility]) into
# candidate blocks of b slots counted from the document's first slot; the last block may be
# partial. It scores the blocks, keeps the ``keep_blocks`` best (ties to the lower block), and
# takes the top-k over the visible slots of the kept blocks (ties to the lower slot)::
#
#     visible slots   s0 s1 s2 s3 | s4 s5 s6 s7 | s8 s9      b = 4, 3 blocks (the last partial)
#     block scores       0.1           0.7         0.3       keep 2 -> blocks 1, 2
#     top-k = 3 over     .  .  .  .  s4 s5 s6 s7   s8 s9
#
# Both levels read only the gathered index keys (block keys are the integration's token-
# local function of them), so a two-level layer moves what a one-level layer moves.
#
# The two levels may sit in different layers. DeepSeek V4.1's candidate source (a Full
# layer, ``index_block = b``) keeps, per query, the blocks of best slot-score maximum (and
# always the latest visible one) while it selects over all its visible slots; each later
# selecting layer (``reuses`` "candidates", the same b) takes its top-k among those blocks
# only. The kept blocks are per local query, like a selection: the owner's
# ``hp_cp_run_attention`` puts them in ``call.outputs["candidates"]`` and the reader gets them
# in ``call.reused["candidates"]`` (Note [Layers that share their indexer] in
# :mod:`hp_cp_core.sharing`); nothing more travels.


def select_two_level_numpy(
    block_scores: np.ndarray,
    slot_scores: np.ndarray,
    slot_start: np.ndarray,
    slot_count: np.ndarray,
    block: int,
    keep_blocks: int,
    topk: int,
) -> np.ndarray:
    """The two-level indexer's picks (Note [Two-level selection]), the reference of the rule.

    Args:
        block_scores: ``[..., n, NB]``: query i's score of its candidate block c.
        slot_scores: ``[..., n, V]``: query i's score of slot ``slot_start[i] + c``.
        slot_start, slot_count: ``[n]`` each query's visible slot range (the plan's
            ``cmp_start`` / ``cmp_count``).
        block: slots per candidate block (``LayerSpec.index_block``).
        keep_blocks: candidate blocks kept per query.
        topk: picks per query.

    Returns:
        ``[..., n, topk]`` global slot ids, descending score (ties to the lower slot),
        ``-1`` where a query has fewer candidates than ``topk``.
    """
    b = max(int(block), 1)
    start = np.asarray(slot_start, dtype=np.int64)
    count = np.asarray(slot_count, dtype=np.int64)
    n_blocks = -(-count // b)
    nb, v = block_scores.shape[-1], slot_scores.shape[-1]
    if nb == 0 or v == 0:
        return np.full((*slot_scores.shape[:-1], int(topk)), -1, dtype=np.int64)
    blk_ok = np.arange(nb)[None, :] < n_blocks[:, None]
    bs = np.where(blk_ok, block_scores, -np.inf)
    kb = min(int(keep_blocks), nb)
    order = np.argsort(-bs, axis=-1, kind="stable")[..., :kb]
    kept_ok = np.take_along_axis(np.broadcast_to(blk_ok, bs.shape), order, axis=-1)
    kept = np.zeros(bs.shape, dtype=bool)
    np.put_along_axis(kept, order, kept_ok, axis=-1)
    cols = np.arange(v)
    slot_ok = (cols[None, :] < count[:, None]) & np.take_along_axis(
        kept, np.broadcast_to(np.minimum(cols // b, max(nb - 1, 0)), kept.shape[:-1] + (v,)), -1
    )
    ss = np.where(slot_ok, slot_scores, -np.inf)
    k = min(int(topk), v)
    pick = np.argsort(-ss, axis=-1, kind="stable")[..., :k]
    ok = np.take_along_axis(slot_ok, pick, axis=-1)
    out = np.where(ok, pick + start[:, None], -1)
    pad = [(0, 0)] * (out.ndim - 1) + [(0, int(topk) - k)]
    return np.pad(out, pad, constant_values=-1)
