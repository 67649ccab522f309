"""Sparse attention of a rank's local queries: the kernel dispatch and the indexer's top-k.

:func:`run_sparse_attention` hands one registered kernel (:mod:`hp_cp_torch.kernels.registry`)
the local queries, the KV and the plan (the small-op reference kernel by default);
:func:`select_topk_chunked` is the indexer's deterministic top-k over the visible slots.
:func:`gather_rows` and :func:`sparse_attention_smallop` are re-exported from the small-op
kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_cp_core.columns import PlanColumns
from hp_cp_torch.kernels.registry import AttentionRequest, kernel_named
from hp_cp_torch.kernels.request import chunk_columns
from hp_cp_torch.kernels.smallop import gather_rows, sparse_attention_smallop

__all__ = [
    "chunk_columns",
    "deterministic_topk",
    "gather_rows",
    "run_sparse_attention",
    "select_topk_chunked",
    "sparse_attention_smallop",
]


SCORE_CHUNK_CELLS = 1 << 22
"""Most (query, slot) scores of one indexer chunk: a chunk's fp32 scores, mask and top-k keys
stay under ~100 MiB per head at any S (:meth:`~hp_cp_core.columns.PlanColumns.score_chunk_rows`)."""

SCORE_HEAD_CELLS = 1 << 24
"""Most (query, head, slot) cells of one indexer chunk's per-head scores: a score callable
builds ``[B, rows, heads, slots]`` in fp32 (often two or three of them) before summing the
heads, so with ``score_heads`` a chunk keeps that under ~64 MiB too (at V4-Flash's 64 index
heads the rows of :data:`SCORE_CHUNK_CELLS` alone would let it reach 1 GiB)."""

HOST_TOPK_MIN_SLOTS = 4096
"""Rows at least this long take :func:`_topk_cpu` on a CPU (Note [Top-k on the host]): it reads
the host, which costs nothing there; shorter rows keep the path with no read at all."""

TOPK_SORT_FRACTION = 4
""":func:`deterministic_topk` sorts whole rows when ``k`` is more than 1 / this of the row."""


def deterministic_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the ``k`` largest entries along the last dim, ties broken by the lower index.

    ``torch.topk`` leaves the order of equal values unspecified (and device dependent); this
    does not, so a sequence-parallel run that scores the same candidate row picks the same
    columns. When ``k`` is a small part of the row (a full sort costs more than the rest of
    the indexer), one ``torch.topk`` over keys that have no ties (Note [Top-k without ties]);
    otherwise one stable descending sort of the row. Both give what a stable descending sort
    gives (NaN first, as the sort puts it), on any device, with no host read.

    Args:
        scores: Scores ``[..., N]``; ``-inf`` entries are allowed (they sort last).
        k: How many to keep, ``0 <= k <= N``.

    Returns:
        ``(values, indices)``, each ``[..., k]``, in descending-score order.
    """
    small_k = 0 < k * TOPK_SORT_FRACTION <= scores.shape[-1]
    if not small_k or scores.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
        return values[..., :k], indices[..., :k]
    if scores.device.type == "cpu" and scores.shape[-1] >= HOST_TOPK_MIN_SLOTS:
        return _topk_cpu(scores, k)
    return _topk_untied(scores, k)


def _topk_untied(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    indices = torch.topk(_untied_keys(scores), k, dim=-1, sorted=True).indices
    return torch.gather(scores, -1, indices), indices


def _topk_cpu(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Note [Top-k on the host]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    On a CPU a host read costs nothing, and the keys of Note [Top-k without ties] (five
    int64 passes over the row) cost most of the indexer's time at long S. So: one
    ``torch.topk`` of the scores themselves; its picked *set* is the stable sort's unless the
    k-th value has an equal that was not picked (a tie at the cut; ``-0.0`` equals ``0.0``)
    or a NaN is about; the picks are then put in the stable order (value descending, lower
    index first) by sorting the k of them. In a row with a tie at the cut (every row that sees
    fewer than k slots, whose cut is ``-inf``; a row whose indexer weights are all negative,
    whose best scores are ReLU's zeros) the picks above the cut stay and the rest are the cut
    value's lowest indices (one int32 top-k); a row with a NaN takes the keys' path. Same
    answer as the stable sort, bit for bit."""
    values, indices = torch.topk(scores, k, dim=-1, sorted=True)
    kth = values[..., -1:]
    cut_tie = (scores == kth).sum(-1) > (values == kth).sum(-1)
    nan = torch.isnan(values).any(-1)
    # stable order of the picked set: by index, then a stable sort by value
    by_index = torch.argsort(indices, dim=-1)
    indices, values = indices.gather(-1, by_index), values.gather(-1, by_index)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    indices = indices.gather(-1, order)
    if not bool((cut_tie | nan).any()):  # a host read: CPU tensors only
        return values, indices
    n = scores.shape[-1]
    flat_s = scores.reshape(-1, n)
    flat_v, flat_i = values.reshape(-1, k), indices.reshape(-1, k)
    tie_rows = (cut_tie & ~nan).reshape(-1).nonzero().squeeze(-1)
    if tie_rows.numel():
        # the picks above the cut stay; the rest are the cut value's lowest indices
        cut = flat_v[tie_rows, -1:]
        above = (flat_v[tie_rows] > cut).sum(-1, keepdim=True)  # first `above` picks
        rank = torch.arange(n, 0, -1, dtype=torch.int32)  # lower index, larger key
        ties = torch.where(flat_s.index_select(0, tie_rows) == cut, rank, 0)
        lowest = n - torch.topk(ties, k, dim=-1, sorted=True).values.long()
        col = torch.arange(k)
        fill = lowest.gather(-1, (col - above).clamp(min=0))
        flat_i[tie_rows] = torch.where(col >= above, fill, flat_i[tie_rows])
        flat_v[tie_rows] = torch.where(col >= above, cut, flat_v[tie_rows])
    nan_rows = nan.reshape(-1).nonzero().squeeze(-1)
    if nan_rows.numel():
        slow_v, slow_i = _topk_untied(flat_s.index_select(0, nan_rows), k)
        flat_v[nan_rows], flat_i[nan_rows] = slow_v, slow_i
    return values, indices


def _untied_keys(scores: torch.Tensor) -> torch.Tensor:
    """Note [Top-k without ties]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    int64 keys in the order a stable descending sort puts ``scores`` (fp32 or narrower) in,
    all distinct, so ``torch.topk`` of the keys has one answer on every device::

        key = orderable(fp32 bits) * 2**32 + (N - 1 - index)
              +-- value order --+          +-- lower index wins a tie --+

    ``orderable`` maps the IEEE bits to int32 in value order (negative floats: all bits but
    the sign flipped), after ``+ 0.0`` turns ``-0.0`` into ``+0.0`` (equal values, a tie) and
    with every NaN above ``+inf`` (the sort puts NaN first). No host read, no data-dependent
    shape (the earlier CPU path counted the ties at the k-th value with ``nonzero``)."""
    bits = (scores.float() + 0.0).view(torch.int32)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    order = torch.where(torch.isnan(scores), torch.iinfo(torch.int32).max, order)
    n = scores.shape[-1]
    rank = torch.arange(n - 1, -1, -1, dtype=torch.int64, device=scores.device)
    return order.to(torch.int64) * (1 << 32) + rank


def select_topk_chunked(
    score_fn: Any,
    plan: Any,
    topk: int,
    query_chunk: int,
    batch: int | None = None,
    *,
    one_process_row: str | None = None,
    sequence_rows: int | None = None,
    cu_seqlens: Any = None,
    score_heads: int = 1,
    row_hook: Any = None,
    ascending: bool = False,
) -> torch.Tensor:
    """Indexer top-k of every local query over its visible slots only, chunk by chunk.

    The chunks, their slot ranges and visibility masks come from the core
    (:meth:`hp_cp_core.columns.PlanColumns.score_chunks`); this runs the scoring and the
    top-k on the scores' device.

    Args:
        score_fn: ``score_fn(lo, hi, s0, s1)`` -> scores ``[B, hi-lo, s1-s0]`` of local queries
            ``lo:hi`` against global slots ``s0:s1``.
        plan: the rank's :class:`hp_cp_core.plan.RankPlan` (``cmp_start`` / ``cmp_count``).
        topk: the layer's ``index_topk``.
        query_chunk: queries per chunk (fewer where a chunk would score more than
            :data:`SCORE_CHUNK_CELLS` slots).
        batch: the batch size ``B``, needed when no local query sees a slot (nothing is
            scored); default: taken from the scores (1 when there are none).
        one_process_row: pick as a model on one process that calls ``torch.topk`` on each
            query's row of every slot (``-inf`` where invisible) does, exactly equal ties
            included (Note [The one-process top-k row] in :mod:`hp_cp_core.columns`): the
            row of a packed document, ``"document"`` (each document alone) or ``"stream"``
            (one row for the packed stream); ``None``: hp_cp's device-independent rule,
            :func:`deterministic_topk`.
        sequence_rows, cu_seqlens: with ``one_process_row``, ``call.sequence_rows`` (the
            rows before ``handle.shard``'s padding) and ``call.cu_seqlens``.
        score_heads: the indexer heads ``score_fn`` scores before summing them: a chunk's
            ``rows * score_heads * slots`` stays under :data:`SCORE_HEAD_CELLS` as well.
        row_hook: with ``one_process_row``, ``row_hook(row_scores, a, b, row)`` gets each
            block of one-process rows (``[B, b - a, row.length]`` fp32, ``-inf`` where
            invisible) of local queries ``a:b`` before the top-k and returns the scores to
            pick from (a model's candidate mask, say); ``None``: the scores as they are.
        ascending: the picks in ascending slot order (a model that calls ``torch.topk(...,
            sorted=False)`` and sorts the ids), else in ``torch.topk``'s descending order.

    Returns:
        Global slot ids ``[B, L, topk]`` (``-1`` for empty picks): in descending-score order,
        lower id first on ties; with ``one_process_row``, the slots ``torch.topk`` keeps.
    """
    if row_hook is not None and one_process_row is None:
        raise ValueError("select_topk_chunked: row_hook needs one_process_row")
    columns = PlanColumns(plan, 0)
    out = None
    cells = min(SCORE_CHUNK_CELLS, SCORE_HEAD_CELLS // max(int(score_heads), 1))
    rows = columns.score_chunk_rows(query_chunk, cells)
    for chunk in columns.score_chunks(rows):
        rows_of = None
        if one_process_row is not None:
            rows_of = columns.topk_rows(
                chunk.lo, chunk.hi, sequence_rows, packed_row=one_process_row, cu_seqlens=cu_seqlens
            )
        out = _pick_chunk(score_fn, chunk, rows_of, topk, plan.n_local, out, row_hook, ascending)
    if out is None:
        out = torch.full((1 if batch is None else batch, plan.n_local, topk), -1, dtype=torch.long)
    return out


def _pick_chunk(
    score_fn: Any,
    chunk: Any,
    rows_of: Any,
    topk: int,
    n_local: int,
    out: Any,
    row_hook: Any = None,
    ascending: bool = False,
) -> torch.Tensor:
    """Score one chunk, mask its invisible slots and write its picks into ``out`` (made here,
    ``[B, n_local, topk]`` of ``-1``, when ``None``): hp_cp's top-k, or, with ``rows_of`` (the
    one-process rows of its queries), ``torch.topk`` as one process does. Every temporary
    dies on return, before the next chunk is scored: a chunk's scoring is the busiest rank's
    peak, and a previous chunk's masked scores alive through it add about a fifth."""
    scores = score_fn(chunk.lo, chunk.hi, chunk.slot_start, chunk.slot_stop).float()
    if out is None:
        shape = (scores.shape[0], n_local, topk)
        out = torch.full(shape, -1, dtype=torch.long, device=scores.device)
    visible = torch.as_tensor(chunk.visible, device=scores.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    del visible
    if rows_of is not None:
        for row in rows_of:
            _topk_as_one_process(scores, chunk, row, topk, out, row_hook, ascending)
        return out
    values, ids = deterministic_topk(scores, chunk.keep(topk))
    picks = torch.where(torch.isneginf(values), -1, ids + chunk.slot_start)
    out[:, chunk.lo : chunk.hi, : picks.shape[-1]] = picks
    return out


ONE_PROCESS_ROW_ELEMENTS = 1 << 24
"""Most scores one rebuilt one-process top-k row block holds (queries x row length)."""


def _topk_as_one_process(
    scores: torch.Tensor,
    chunk: Any,
    row: Any,
    topk: int,
    out: torch.Tensor,
    row_hook: Any = None,
    ascending: bool = False,
) -> None:
    """``torch.topk`` over the one-process row of the queries ``row.lo:row.hi`` (their
    scores ``scores[:, i]`` over the chunk's slots placed at their slot ids, ``-inf`` around
    them; through ``row_hook`` when given), written into ``out`` as global slot ids (``-1``:
    an invisible pick), in ascending slot order with ``ascending``."""
    keep = row.keep(topk)
    if keep == 0:
        return
    lo = max(chunk.slot_start, row.start)
    hi = min(chunk.slot_stop, row.start + row.length)
    step = max(ONE_PROCESS_ROW_ELEMENTS // max(row.length, 1), 1)
    for a in range(row.lo, row.hi, step):
        b = min(a + step, row.hi)
        full = scores.new_full((scores.shape[0], b - a, row.length), float("-inf"))
        if hi > lo:
            part = scores[
                :, a - chunk.lo : b - chunk.lo, lo - chunk.slot_start : hi - chunk.slot_start
            ]
            full[..., lo - row.start : hi - row.start] = part
        if row_hook is not None:
            full = row_hook(full, a, b, row)
        values, ids = torch.topk(full, keep, dim=-1, sorted=not ascending)
        if ascending:
            ids = ids.sort(dim=-1).values
            values = full.gather(-1, ids)
        out[:, a:b, :keep] = torch.where(torch.isneginf(values), -1, ids + row.start)


def run_sparse_attention(
    q: torch.Tensor,
    ori_ext: torch.Tensor,
    cmp_kv: torch.Tensor | None,
    plan: Any,
    selected: torch.Tensor | None,
    sink: torch.Tensor | None,
    scale: float,
    *,
    kernel: Any = "smallop",
    query_chunk: int = 1024,
    banded_picks: str = "weights",
) -> torch.Tensor:
    """Attention of the local queries over the window and the compressed slots of the plan.

    Columns keep the single-device order: the window (ascending, -1 padded to W), then the
    compressed slots (the indexer's picks for r = 4, every visible slot ascending for r = 128).

    Args:
        q, ori_ext, cmp_kv, plan, selected, sink, scale, query_chunk: as the fields of
            :class:`~hp_cp_torch.kernels.request.AttentionRequest`.
        kernel: a registered kernel's name (:mod:`hp_cp_torch.kernels.registry`: ``"banded"``,
            ``"smallop"``, ``"efficient"``, ``"triton"``, ``"model_ops"`` or a third
            party's) or a kernel object; it is called once with an
            :class:`~hp_cp_torch.kernels.registry.AttentionRequest`.
        banded_picks: how the banded kernel reads picks that lie in a block's slot band
            (:data:`hp_cp_torch.kernels.banded.PICK_READS`; the same result each way, the
            benchmark measures each).

    Returns:
        ``[B, L, H, D]``.
    """
    request = AttentionRequest(
        q, ori_ext, cmp_kv, plan, selected, sink, scale, query_chunk, {"picks": banded_picks}
    )
    return kernel_named(kernel)(request)
