"""The per-rank CP plan: who sends which rows to whom, which slots a rank owns, and the
local-frame index arrays. Plain numpy data, built once per input shape and cached.

Note [Halos and the ext frame]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each run (contiguous chunk of local rows, see Note [Row layouts]) starting at row ``a``
needs the rows ``[h, a)`` before it: for the window ``h = max(doc_start(a), a - W + 1)``,
for the compressor the first row read by its first owned slot. When L < W - 1 the window
halo spans several ranks; every owner sends its part straight to the reader::

    W = 8, L = 3, cp = 4      rank 0: rows 0 1 2   rank 1: 3 4 5   rank 2: 6 7 8
    rank 2's window halo = rows 1..5  <- rank 0 sends [1, 2], rank 1 sends [3, 4, 5]

A rank's *ext frame* is the ascending union of its halo rows and its own rows, so every
query's window is one contiguous range of it. ``exchange_rows`` returns
``[received (source-rank order) ; local]``; ``HaloPlan.ext_from_recv`` reorders that into the
ext frame, or is ``None`` when it already is (always for the contiguous layout, where the
ext frame is simply ``[halo ; local]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hp_cp_core.errors import PlanError
from hp_cp_core.indices import (
    SlotTable,
    build_cmp_cu_seqlens,
    build_select_pad_gather_index,
    build_slot_table,
    compressed_visibility,
    document_slot_ranges,
    slot_owners,
    window_start_rows,
)
from hp_cp_core.layout import Documents, SequenceLayout
from hp_cp_core.slot_exchange import SlotExchangePlan, build_slot_exchange, visible_slot_ranges
from hp_cp_core.spec import LayerSpec


@dataclass(frozen=True, eq=False)
class HaloPlan:
    """Rows of one tensor kind (window KV, or compressor input x) moved between ranks.

    Attributes:
        send_rows: per destination rank, the local rows (indices into this rank's tensor)
            to send there, ascending.
        recv_counts: per source rank, how many rows arrive from it.
        halo_rows: global rows received, ascending.
        ext_rows: global rows of the ext frame (halo and local, ascending).
        ext_from_recv: index into ``[received ; local]`` giving the ext frame, ``None`` if equal.
        ext_from_halo: index into ``[halo_rows ; local]`` giving the ext frame, ``None`` if equal.
        halo_gather: index into the received rows giving ``halo_rows`` order, ``None`` if equal.
    """

    send_rows: tuple[np.ndarray, ...]
    recv_counts: tuple[int, ...]
    halo_rows: np.ndarray
    ext_rows: np.ndarray
    ext_from_recv: np.ndarray | None
    ext_from_halo: np.ndarray | None
    halo_gather: np.ndarray | None
    exchange_name = "halo_exchange"

    @property
    def n_halo(self) -> int:
        """Rows received (the halo length)."""
        return int(self.halo_rows.size)

    @property
    def send_total(self) -> int:
        return int(sum(s.size for s in self.send_rows))


@dataclass(frozen=True)
class CompressSegment:
    """One compressor call: a contiguous run of ext-frame x rows starting on a block boundary.

    Attributes:
        ext_start: first x_ext row fed to the compressor.
        ext_stop: one past the last x_ext row.
        rope_pos_offset: RoPE position of the first block of the input.
        drop_first: the first output slot only served as overlap predecessor; drop it.
        n_slots: owned slots this call yields (after the drop).
    """

    ext_start: int
    ext_stop: int
    rope_pos_offset: int
    drop_first: bool
    n_slots: int


@dataclass(frozen=True)
class AttentionRun:
    """One contiguous run of local queries and its ``[halo ; run]`` slice of the ext frame.

    Attributes:
        local_start, local_stop: the run's local rows.
        pos_offset: global row of the run's first row.
        ext_start, ext_stop: the run's rows of the window ext frame (halo first).
        halo_len: halo rows at the front of that slice.
    """

    local_start: int
    local_stop: int
    pos_offset: int
    ext_start: int
    ext_stop: int
    halo_len: int


@dataclass(frozen=True)
class DocumentRun:
    """One contiguous run of local queries inside one document: what an attention function
    that knows nothing of CP needs to treat the run as rows of that document alone.

    Attributes:
        local_start, local_stop: the run's local rows.
        doc: the document (index into ``cu_seqlens``; 0 when padded).
        pos_offset: position of the run's first row on the layer's grid (inside its document
            on the per-document grid; the global row when padded or on the global grid).
        ext_start, ext_stop: the run's rows of the window ext frame (halo first); the halo
            never crosses the document's start.
        halo_len: halo rows at the front of that slice.
        cmp_start, cmp_stop: the document's slots in the global slot buffer (``0 ..
            n_needed_slots``), the document's first slot first; the run's query at position
            ``t`` sees the first ``(t + 1) // r`` of them (per-document grid).
    """

    local_start: int
    local_stop: int
    doc: int
    pos_offset: int
    ext_start: int
    ext_stop: int
    halo_len: int
    cmp_start: int
    cmp_stop: int


@dataclass(frozen=True, eq=False)
class RankPlan:
    """Everything one rank needs to run one layer forward under CP.

    Attributes:
        rank: this rank. cp_size: the group size.
        local_rows: global row of each local row (local order).
        positions: RoPE position of each local row (document-relative on the per-document
            grid when packed; the global row otherwise).
        runs: ``(local_start, local_stop, global_start)`` of each contiguous local run.
        window: the window KV :class:`HaloPlan`.
        x: the compressor-input :class:`HaloPlan` (``None`` when r = 0).
        window_start: per local query, first key in the window ext frame.
        window_len: per local query, number of window keys (<= W).
        cmp_start: per local query, first visible slot in the global slot buffer.
        cmp_count: per local query, number of visible slots.
        owned_slots: global ids of the slots this rank computes (ascending).
        owned_rope_pos: their RoPE positions.
        segments: the compressor calls that produce ``owned_slots``.
        n_slots_total: slots of the whole sequence.
        gather_cap: rows each rank contributes to the compressed all-gather (max owned).
        gather_index: position of global slot s in the rank-major all-gather buffer.
        n_needed_slots: global slots ``0 .. n-1`` this rank's queries may read.
        cmp_cu_seqlens: compressed document boundaries (per-document grid), else ``None``.
        slot_exchange: the point-to-point alternative to the all-gather (only the slots this
            rank's queries see; Note [Causal-prefix slot exchange]); ``None`` when r = 0.
        document_runs: the runs cut at document boundaries (:class:`DocumentRun`; one per
            run when padded).
        send_bytes_rows / recv rows are in the HaloPlans; ``owned_counts`` per rank.
        column_work: :class:`hp_cp_core.columns.PlanColumns`' chunk lists, built on first use
            and kept with the (cached) plan, so a forward and its recompute reuse them.
    """

    rank: int
    cp_size: int
    layout: SequenceLayout
    spec: LayerSpec
    local_rows: np.ndarray
    positions: np.ndarray
    runs: tuple[tuple[int, int, int], ...]
    window: HaloPlan
    x: HaloPlan | None
    window_start: np.ndarray
    window_len: np.ndarray
    cmp_start: np.ndarray
    cmp_count: np.ndarray
    owned_slots: np.ndarray
    owned_rope_pos: np.ndarray
    segments: tuple[CompressSegment, ...]
    n_slots_total: int
    owned_counts: np.ndarray
    gather_cap: int
    gather_index: np.ndarray
    n_needed_slots: int
    cmp_cu_seqlens: np.ndarray | None
    slot_exchange: SlotExchangePlan | None = None
    document_runs: tuple[DocumentRun, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    column_work: dict[tuple, Any] = field(default_factory=dict, repr=False)

    def attention_runs(self) -> list[AttentionRun]:
        """Per contiguous local run, its slice of the window ext frame (for adapters whose
        attention takes ``[halo ; local]`` plus ``pos_offset`` / ``ori_halo_len``)."""
        out = []
        for lo, hi, g0 in self.runs:
            if hi <= lo:
                continue
            ext_start = int(self.window_start[lo])
            run_first_ext = int(self.window_start[lo] + self.window_len[lo] - 1)
            ext_stop = int(self.window_start[hi - 1] + self.window_len[hi - 1])
            out.append(AttentionRun(lo, hi, g0, ext_start, ext_stop, run_first_ext - ext_start))
        return out

    @property
    def n_local(self) -> int:
        return int(self.local_rows.size)

    @property
    def n_owned(self) -> int:
        return int(self.owned_slots.size)


def _document_runs(
    runs: tuple[tuple[int, int, int], ...],
    local_doc: np.ndarray,
    positions: np.ndarray,
    window_start: np.ndarray,
    window_len: np.ndarray,
    doc_slots: tuple[np.ndarray, np.ndarray],
    n_needed: int,
) -> tuple[DocumentRun, ...]:
    """Cut the local runs where the document changes (see :class:`DocumentRun`)."""
    n = local_doc.size
    if n == 0:
        return ()
    brk = np.zeros(n, dtype=bool)
    brk[[lo for lo, hi, _ in runs if hi > lo]] = True
    brk[1:] |= local_doc[1:] != local_doc[:-1]
    first = np.flatnonzero(brk)
    stop = np.concatenate([first[1:], [n]])
    last = stop - 1
    ext_start = window_start[first]
    halo = window_start[first] + window_len[first] - 1 - ext_start
    ext_stop = window_start[last] + window_len[last]
    doc = local_doc[first]
    slot_a = np.minimum(doc_slots[0][doc], n_needed)
    slot_b = np.maximum(np.minimum(doc_slots[1][doc], n_needed), slot_a)
    cols = (first, stop, doc, positions[first], ext_start, ext_stop, halo, slot_a, slot_b)
    return tuple(DocumentRun(*(int(v) for v in row)) for row in zip(*cols))


def _intervals_to_rows(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(start, stop)`` for a few intervals (one per run)."""
    parts = [np.arange(a, b, dtype=np.int64) for a, b in zip(starts.tolist(), stops.tolist())]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def _halo_starts(
    layout: SequenceLayout,
    docs: Documents,
    spec: LayerSpec,
    slots: SlotTable,
    owners: np.ndarray,
    kind: str,
) -> list[list[tuple[int, int]]]:
    """Per rank, per run: the halo interval ``[h, run_start)`` (``h == run_start`` if none)."""
    out = []
    for rank in range(layout.cp_size):
        per_run = []
        for a, b in layout.runs(rank):
            if a >= b:
                per_run.append((a, a))
                continue
            if kind == "window":
                h = int(window_start_rows(np.array([a]), docs, spec.window_size)[0])
            else:  # first slot whose last row lies in [a, b)
                k = int(np.searchsorted(slots.last_row, a, side="left"))
                if k < slots.n_slots and slots.last_row[k] < b:
                    h = min(int(slots.dep_start[k]), a)
                else:
                    h = a
            per_run.append((h, a))
        out.append(per_run)
    return out


def _halo_plan(layout: SequenceLayout, halos: list[list[tuple[int, int]]], rank: int) -> HaloPlan:
    """Build the send / receive lists of one tensor kind for ``rank``."""
    cp = layout.cp_size

    def needed(k: int) -> np.ndarray:
        iv = np.array(halos[k], dtype=np.int64).reshape(-1, 2)
        rows = _intervals_to_rows(iv[:, 0], iv[:, 1])
        return rows[layout.rank_of(rows) != k]

    halo_rows = needed(rank)
    src = layout.rank_of(halo_rows)
    recv_counts = tuple(int(c) for c in np.bincount(src, minlength=cp)) if cp else ()
    send_rows = []
    for dst in range(cp):
        if dst == rank:
            send_rows.append(np.zeros(0, dtype=np.int64))
            continue
        rows = needed(dst)
        mine = rows[layout.rank_of(rows) == rank]
        send_rows.append(layout.local_index(mine))
    # received rows arrive grouped by source rank (stable), ascending inside each source
    order = np.argsort(src, kind="stable")  # received position -> halo_rows position
    identity = np.array_equal(order, np.arange(order.size))
    halo_gather = None if identity else np.argsort(order, kind="stable")  # halo = recv[gather]
    local = layout.rank_rows(rank)
    # halo rows are never local, so a sort is the union (np.unique hashes: ~20x slower)
    ext_rows = np.sort(np.concatenate([halo_rows, local]))
    # position of each ext row inside [received ; local]
    recv_pos_of_halo = np.empty(halo_rows.size, dtype=np.int64)
    recv_pos_of_halo[order] = np.arange(order.size, dtype=np.int64)
    is_local = layout.rank_of(ext_rows) == rank
    from_halo = np.empty(ext_rows.size, dtype=np.int64)
    from_halo[is_local] = halo_rows.size + layout.local_index(ext_rows[is_local])
    from_halo[~is_local] = np.searchsorted(halo_rows, ext_rows[~is_local])
    from_recv = from_halo.copy()
    from_recv[~is_local] = recv_pos_of_halo[from_halo[~is_local]]

    def unless_identity(idx: np.ndarray) -> np.ndarray | None:
        return None if np.array_equal(idx, np.arange(idx.size)) else idx

    return HaloPlan(
        send_rows=tuple(send_rows),
        recv_counts=recv_counts,
        halo_rows=halo_rows,
        ext_rows=ext_rows,
        ext_from_recv=unless_identity(from_recv),
        ext_from_halo=unless_identity(from_halo),
        halo_gather=halo_gather,
    )


def _segments(
    slots: SlotTable, owned: np.ndarray, layout: SequenceLayout, x_ext_rows: np.ndarray, r: int
) -> tuple[CompressSegment, ...]:
    """Group owned slots into compressor calls: consecutive slots of one run and grid unit."""
    if owned.size == 0:
        return ()
    run_id = layout.local_index(slots.last_row[owned]) // max(layout.chunk_rows, 1)
    brk = (np.diff(owned) != 1) | (np.diff(slots.unit[owned]) != 0) | (np.diff(run_id) != 0)
    first = np.concatenate([[0], np.flatnonzero(brk) + 1])
    last = np.concatenate([first[1:] - 1, [owned.size - 1]])
    s0, s1 = owned[first], owned[last]
    ext_a = np.searchsorted(x_ext_rows, slots.dep_start[s0])
    ext_b = np.searchsorted(x_ext_rows, slots.last_row[s1]) + 1
    drop = slots.has_pred[s0]
    offset = slots.rope_pos[s0] - np.where(drop, r, 0)
    return tuple(
        CompressSegment(int(a), int(b), int(o), bool(d), int(n))
        for a, b, o, d, n in zip(ext_a, ext_b, offset, drop, last - first + 1)
    )


def build_rank_plan(
    *,
    rank: int,
    cp_size: int,
    spec: LayerSpec,
    layout_kind: str,
    total_rows: int,
    cu_seqlens: np.ndarray | None = None,
) -> RankPlan:
    """Plan one layer forward for ``rank`` (vectorised; see the Notes in this package)."""
    if not 0 <= rank < cp_size:
        raise PlanError(f"rank {rank} is outside the CP group of size {cp_size}.")
    layout = SequenceLayout(layout_kind, cp_size, int(total_rows))
    packed = cu_seqlens is not None
    docs = Documents.packed(cu_seqlens, total_rows) if packed else Documents.padded(total_rows)
    grid = spec.packed_grid if packed else "per_document"
    r = int(spec.compress_ratio)
    slots = build_slot_table(docs, r, spec.overlap, grid)
    owners = slot_owners(slots, layout.rank_of)
    local_rows = layout.rank_rows(rank)

    win_halos = _halo_starts(layout, docs, spec, slots, owners, "window")
    window = _halo_plan(layout, win_halos, rank)
    x_plan = None
    if spec.makes_slots:  # Note [Layers that share their indexer]: no compressor, no x halo
        x_plan = _halo_plan(layout, _halo_starts(layout, docs, spec, slots, owners, "x"), rank)

    w0 = window_start_rows(local_rows, docs, spec.window_size)
    window_start = np.searchsorted(window.ext_rows, w0)
    window_len = local_rows - w0 + 1
    cmp_start, cmp_count = compressed_visibility(local_rows, docs, r, grid)

    owned = np.flatnonzero(owners == rank).astype(np.int64)
    segments = _segments(slots, owned, layout, x_plan.ext_rows, r) if x_plan else ()
    gather_index, cap = build_select_pad_gather_index(owners, cp_size)
    # queries that see no slot may have cmp_start past the last slot (global grid): skip them
    seen = cmp_count > 0
    needed = int((cmp_start + cmp_count)[seen].max()) if seen.any() else 0
    slot_exchange = None
    if spec.makes_slots:
        ranges = visible_slot_ranges(layout, docs, r, grid)
        slot_exchange = build_slot_exchange(owners, ranges, rank, cp_size, needed)
    if grid == "per_document" and packed:
        positions = local_rows - docs.start_of(local_rows)
    else:
        positions = local_rows.copy()
    runs, off = [], 0
    for a, b in layout.runs(rank):
        runs.append((off, off + (b - a), a))
        off += b - a
    doc_runs = _document_runs(
        tuple(runs),
        docs.doc_of(local_rows),
        positions,
        window_start,
        window_len,
        document_slot_ranges(docs, r, grid),
        needed,
    )
    return RankPlan(
        rank=rank,
        cp_size=cp_size,
        layout=layout,
        spec=spec,
        local_rows=local_rows,
        positions=positions,
        runs=tuple(runs),
        window=window,
        x=x_plan,
        window_start=window_start,
        window_len=window_len,
        cmp_start=cmp_start,
        cmp_count=cmp_count,
        owned_slots=owned,
        owned_rope_pos=slots.rope_pos[owned],
        segments=segments,
        n_slots_total=slots.n_slots,
        owned_counts=np.bincount(owners, minlength=cp_size) if owners.size else np.zeros(cp_size),
        gather_cap=cap,
        gather_index=gather_index,
        n_needed_slots=needed,
        cmp_cu_seqlens=build_cmp_cu_seqlens(docs.cu_seqlens, r) if packed and r else None,
        slot_exchange=slot_exchange,
        document_runs=doc_runs,
    )


class PlanCache:
    """Plans keyed by everything they depend on; one cache per ``enable_cp`` handle.

    Holds at most ``max_entries`` plans (``CPConfig.plan_cache_size``) and drops
    the least recently used one first, so packed batches whose ``cu_seqlens`` all differ
    cannot grow it without bound while a recurring shape stays cached.
    """

    def __init__(self, max_entries: int = 64) -> None:
        if int(max_entries) < 1:
            raise PlanError(f"a plan cache holds >= 1 plan, got max_entries={max_entries}.")
        self._plans: dict[tuple, RankPlan] = {}
        self._max = int(max_entries)
        self.hits = 0
        self.misses = 0

    def get(
        self,
        *,
        rank: int,
        cp_size: int,
        spec: LayerSpec,
        layout_kind: str,
        total_rows: int,
        cu_seqlens: np.ndarray | None,
    ) -> RankPlan:
        """The cached plan, built on first use."""
        cu_key = None if cu_seqlens is None else np.asarray(cu_seqlens, np.int64).tobytes()
        key = (rank, cp_size, spec, layout_kind, int(total_rows), cu_key)
        plan = self._plans.pop(key, None)
        if plan is not None:
            self.hits += 1
            self._plans[key] = plan  # most recently used last
            return plan
        self.misses += 1
        plan = build_rank_plan(
            rank=rank,
            cp_size=cp_size,
            spec=spec,
            layout_kind=layout_kind,
            total_rows=total_rows,
            cu_seqlens=cu_seqlens,
        )
        if len(self._plans) >= self._max:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan

    def stats(self) -> dict[str, int]:
        """Plans held, the most it may hold, and lookups served from / missing the cache."""
        return {
            "plans": len(self._plans),
            "capacity": self._max,
            "hits": self.hits,
            "misses": self.misses,
        }
