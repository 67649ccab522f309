"""Slots, visibility and gather indices: the index math of CP, vectorised with numpy.

Note [Compressed slots and visibility]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A compressor turns each complete block of r rows into one slot; with overlap (r = 4) slot j
also reads block j-1. A slot belongs to the rank holding its **last** row::

    rows      0 1 2 3 | 4 5 6 7 | 8 9 10 11 |      r = 4, L = 6, cp = 2
    ranks     0 0 0 0   0 0 1 1   1 1 1  1
    slot      s0        s1        s2             s1 ends on row 7 -> rank 1 owns it and
    reads     [0..3]    [0..7]    [4..11]        needs x rows 4, 5 from rank 0 (x halo)

Query t sees slot j iff the slot's last row is <= t and both lie in one document, so the
visible slots of a query are a contiguous range of the global slot buffer:
``[cmp_start[t], cmp_start[t] + cmp_count[t])`` (HCA attends all of it, CSA's indexer picks
its top-k out of it). Slots are numbered in global order:

* per-document grid (DeepSeek / Megatron): the grid restarts at each document,
  ``n_b // r`` slots per document, numbered document by document (``build_cmp_cu_seqlens``);
  RoPE position ``j*r`` inside the document; the first slot of a document has no predecessor.
* global grid (MindFormers): slot g covers rows ``[g*r, g*r + r)`` of the packed stream and
  is visible only if it lies inside the query's document; RoPE position ``g*r``; the overlap
  predecessor may come from the previous document (only slot 0 has none).

Single-device column order per query: the window (keys ``max(doc_start, t-W+1) .. t``
ascending, then -1 padding to W columns), then compressed slots (ascending for r = 128,
indexer top-k order for r = 4). :func:`window_index_dense` and
:func:`compressed_index_dense` materialise those columns for a block of queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hp_cp_core.layout import Documents


def build_cmp_cu_seqlens(cu_seqlens: np.ndarray, compress_ratio: int) -> np.ndarray:
    """Compressed-slot boundaries per document for the per-document grid: ``cumsum(n_b // r)``."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    counts = np.diff(cu) // int(compress_ratio) if compress_ratio > 0 else np.zeros(cu.size - 1)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


@dataclass(frozen=True, eq=False)
class SlotTable:
    """Every compressed slot of the sequence, in global slot order (units: rows, slots).

    Attributes:
        block_start: first row of the slot's own block.
        dep_start: first row the slot reads (``block_start - r`` with a predecessor).
        last_row: last row of the slot's own block (decides the owner).
        rope_pos: RoPE position of the slot (first row of its block, grid-relative).
        has_pred: the slot reads a predecessor block (overlap and not first in its grid).
        doc: document of the slot's block (-1 on the global grid when the block straddles).
        unit: grid unit (document id on the per-document grid, 0 on the global grid).
    """

    block_start: np.ndarray
    dep_start: np.ndarray
    last_row: np.ndarray
    rope_pos: np.ndarray
    has_pred: np.ndarray
    doc: np.ndarray
    unit: np.ndarray

    @property
    def n_slots(self) -> int:
        return int(self.block_start.size)


def build_slot_table(docs: Documents, compress_ratio: int, overlap: bool, grid: str) -> SlotTable:
    """All slots of the sequence (see Note [Compressed slots and visibility])."""
    r = int(compress_ratio)
    if r <= 0:
        e = np.zeros(0, dtype=np.int64)
        return SlotTable(e, e, e, e, e.astype(bool), e, e)
    if grid == "global":
        g = np.arange(docs.total_rows // r, dtype=np.int64)
        block_start = g * r
        rope_pos = block_start
        first = g == 0
        d0 = docs.doc_of(block_start)
        d1 = docs.doc_of(block_start + r - 1)
        doc = np.where(d0 == d1, d0, -1)
        unit = np.zeros_like(g)
    else:
        cmp_cu = build_cmp_cu_seqlens(docs.cu_seqlens, r)
        counts = np.diff(cmp_cu)
        doc = np.repeat(np.arange(docs.n_docs, dtype=np.int64), counts)
        j = np.arange(int(cmp_cu[-1]), dtype=np.int64) - cmp_cu[doc]
        block_start = docs.cu_seqlens[doc] + j * r
        rope_pos = j * r
        first = j == 0
        unit = doc
    has_pred = (~first) if overlap else np.zeros_like(first)
    dep_start = block_start - np.where(has_pred, r, 0)
    return SlotTable(block_start, dep_start, block_start + r - 1, rope_pos, has_pred, doc, unit)


def compressed_visibility(
    rows: np.ndarray, docs: Documents, compress_ratio: int, grid: str
) -> tuple[np.ndarray, np.ndarray]:
    """Visible slot range ``(start, count)`` in the global slot buffer for each query row."""
    rows = np.asarray(rows, dtype=np.int64)
    r = int(compress_ratio)
    if r <= 0:
        z = np.zeros(rows.size, dtype=np.int64)
        return z, z
    d = docs.doc_of(rows)
    s_b = docs.cu_seqlens[d]
    e_b = docs.cu_seqlens[d + 1]
    if grid == "global":
        start = -(-s_b // r)  # first block fully inside the document
        stop = np.minimum((rows + 1) // r, e_b // r)
    else:
        cmp_cu = build_cmp_cu_seqlens(docs.cu_seqlens, r)
        start = cmp_cu[d]
        stop = start + np.minimum((rows - s_b + 1) // r, (e_b - s_b) // r)
    return start, np.maximum(stop - start, 0)


def document_slot_ranges(
    docs: Documents, compress_ratio: int, grid: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(start, stop)`` per document: its slots in global slot order (``stop >= start``)."""
    r = int(compress_ratio)
    if r <= 0:
        z = np.zeros(docs.n_docs, dtype=np.int64)
        return z, z
    if grid == "global":  # blocks fully inside the document
        start = -(-docs.cu_seqlens[:-1] // r)
        return start, np.maximum(docs.cu_seqlens[1:] // r, start)
    cmp_cu = build_cmp_cu_seqlens(docs.cu_seqlens, r)
    return cmp_cu[:-1], cmp_cu[1:]


def window_start_rows(rows: np.ndarray, docs: Documents, window_size: int) -> np.ndarray:
    """First key row of each query's window: ``max(doc_start, t - W + 1)``."""
    rows = np.asarray(rows, dtype=np.int64)
    return np.maximum(docs.start_of(rows), rows - int(window_size) + 1)


def window_index_dense(start: np.ndarray, length: np.ndarray, window_size: int) -> np.ndarray:
    """``[n, W]`` window columns in single-device order: ascending keys, then -1 padding."""
    cols = np.arange(int(window_size), dtype=np.int64)
    idx = np.asarray(start, dtype=np.int64)[:, None] + cols[None, :]
    return np.where(cols[None, :] < np.asarray(length)[:, None], idx, -1)


def compressed_index_dense(start: np.ndarray, count: np.ndarray, width: int) -> np.ndarray:
    """``[n, width]`` ascending visible slot columns (HCA order), -1 padded."""
    cols = np.arange(int(width), dtype=np.int64)
    idx = np.asarray(start, dtype=np.int64)[:, None] + cols[None, :]
    return np.where(cols[None, :] < np.asarray(count)[:, None], idx, -1)


def slot_owners(slots: SlotTable, rank_of) -> np.ndarray:  # noqa: ANN001 - a vectorised map
    """Owner rank of every slot: the rank holding its last row."""
    return np.asarray(rank_of(slots.last_row), dtype=np.int64)


def build_select_pad_gather_index(owners: np.ndarray, cp_size: int) -> tuple[np.ndarray, int]:
    """Where each global slot lands in the rank-major padded all-gather buffer.

    Every rank contributes its owned slots (ascending) padded to ``cap`` rows, so the
    all-gather has one shape on every rank; slot s sits at ``owner*cap + k`` where k counts
    the earlier slots of the same owner. Returns ``(index [n_slots], cap)``.
    """
    owners = np.asarray(owners, dtype=np.int64)
    counts = np.bincount(owners, minlength=cp_size) if owners.size else np.zeros(cp_size, int)
    cap = int(counts.max()) if counts.size else 0
    order = np.argsort(owners, kind="stable")
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    within = np.empty_like(owners)
    within[order] = np.arange(owners.size, dtype=np.int64) - first[owners[order]]
    return owners * cap + within, cap


def lookback_index(window_start: np.ndarray, window_len: np.ndarray, n: int) -> np.ndarray:
    """``[L, n]`` window ext-frame rows of ``t, t-1, .., t-n+1`` per query (a plan's
    ``window_start`` / ``window_len`` with ``W >= n``), ``-1`` where the row lies before the
    query's document (or the sequence) starts.

    What a token-local lookup over the previous ``n - 1`` tokens (DeepSeek V4.1's Engram
    n-gram hashes) reads: the window halo of a plan with ``window_size = n`` brings those
    rows, this says where each query finds them.
    """
    last = np.asarray(window_start, dtype=np.int64) + np.asarray(window_len, dtype=np.int64) - 1
    shift = np.arange(int(n), dtype=np.int64)
    rows = last[:, None] - shift[None, :]
    return np.where(shift[None, :] < np.asarray(window_len)[:, None], rows, -1)
