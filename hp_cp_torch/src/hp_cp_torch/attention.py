"""Sparse attention with an attention sink: the small-op (gather) reference kernel.

Every query row attends to an explicit list of rows of a shared KV pool (one KV head,
K == V), plus a per-head *sink*: a virtual key with logit ``sink[h]`` and value 0, so it
only enters the softmax denominator. This is the DeepSeek V4 attention core, see
docs/semantics.md section 5.

The kernel here gathers the selected rows and runs the softmax in fp32. It is the exact
reference that other kernels are checked against; its memory grows with the number of
selected columns.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_cp_core.columns import PlanColumns

__all__ = [
    "chunk_columns",
    "deterministic_topk",
    "gather_rows",
    "run_sparse_attention",
    "select_topk_chunked",
    "sparse_attention_smallop",
]


TOPK_SORT_FRACTION = 4
""":func:`deterministic_topk` sorts whole rows when ``k`` is more than 1 / this of the row."""


def gather_rows(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``pool[b, idx[b, ...]]`` per batch row: ``pool [B, P, ...]``, ``idx [B or 1, ...]`` in
    ``[0, P)`` -> ``[B, ..., *pool.shape[2:]]``; the same values as advanced indexing.

    Its backward is bitwise reproducible on every device. Duplicate indices make the
    backward a scatter-add: advanced indexing's (``index_put_`` with accumulate) sums them in
    a thread-dependent order on CPU, ``index_select``'s (``index_add_``) uses atomics on CUDA.
    So CPU uses ``index_select`` on the flattened pool and other devices advanced indexing.
    """
    batch, n_rows, feat = pool.shape[0], pool.shape[1], pool.shape[2:]
    shape = (-1, *([1] * (idx.dim() - 1)))
    if pool.device.type != "cpu":
        return pool[torch.arange(batch, device=idx.device).view(shape), idx]
    flat = idx + (torch.arange(batch, device=idx.device) * n_rows).view(shape)
    out = pool.reshape(batch * n_rows, *feat).index_select(0, flat.reshape(-1))
    return out.view(*flat.shape, *feat)


def sparse_attention_smallop(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attend each query to the KV-pool rows listed in ``idx``, with an attention sink.

    For query ``(b, s)`` and head ``h``, with ``s_i = scale * q[b,s,h] . kv_pool[b, idx[b,s,i]]``
    (``-inf`` where ``idx == -1``) and ``m = max(max_i s_i, sink[h])``::

        o = sum_i exp(s_i - m) kv_i / (sum_i exp(s_i - m) + exp(sink[h] - m))

    The max includes the sink (the Megatron / MindFormers form), so a row whose every column
    is ``-1`` gives exactly 0 and finite gradients. Softmax math runs in fp32.

    Args:
        q: Queries ``[B, S, H, D]``.
        kv_pool: The shared KV rows ``[B, P, D]`` (keys and values are the same vectors).
        idx: Column lists ``[B, S, K]`` (int32 or int64) of rows of ``kv_pool``; ``-1``
            marks an empty column. The column order is kept (it only affects rounding).
        sink: Per-head sink logits ``[H]`` (used in fp32).
        scale: Softmax scale applied to ``q . kv``.

    Returns:
        The attention output ``[B, S, H, D]`` in ``q``'s dtype.
    """
    batch, _, _, dim = q.shape
    idx = idx.long()
    valid = idx >= 0  # [B, S, K]
    if kv_pool.shape[1] == 0:  # nothing to gather from: every column must be -1
        kv_pool = kv_pool.new_zeros(batch, 1, dim)
    kv_sel = gather_rows(kv_pool, idx.clamp(min=0)).float()  # [B, S, K, D]
    logits = torch.einsum("bshd,bskd->bshk", q.float(), kv_sel) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sink_f = sink.float().view(1, 1, -1, 1)  # [1, 1, H, 1]
    if logits.shape[-1] == 0:
        m = sink_f.expand(*logits.shape[:-1], 1)
    else:
        m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink_f)
    # The output does not depend on m mathematically, so it carries no gradient.
    m = m.detach()
    p = torch.exp(logits - m)  # exp(-inf) = 0 for empty columns
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink_f - m)
    out = torch.einsum("bshk,bskd->bshd", p / denom, kv_sel)
    return out.to(q.dtype)


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
    indices = torch.topk(_untied_keys(scores), k, dim=-1, sorted=True).indices
    return torch.gather(scores, -1, indices), indices


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
        query_chunk: queries per chunk.
        batch: the batch size ``B``, needed when no local query sees a slot (nothing is
            scored); default: taken from the scores (1 when there are none).

    Returns:
        Global slot ids ``[B, L, topk]`` in descending-score order (lower id first on ties),
        ``-1`` for empty picks.
    """
    out = None
    for chunk in PlanColumns(plan, 0).score_chunks(query_chunk):
        scores = score_fn(chunk.lo, chunk.hi, chunk.slot_start, chunk.slot_stop).float()
        if out is None:
            shape = (scores.shape[0], plan.n_local, topk)
            out = torch.full(shape, -1, dtype=torch.long, device=scores.device)
        visible = torch.as_tensor(chunk.visible, device=scores.device)
        values, ids = deterministic_topk(
            scores.masked_fill(~visible, float("-inf")), chunk.keep(topk)
        )
        picks = torch.where(torch.isneginf(values), -1, ids + chunk.slot_start)
        out[:, chunk.lo : chunk.hi, : picks.shape[-1]] = picks
    if out is None:
        out = torch.full((1 if batch is None else batch, plan.n_local, topk), -1, dtype=torch.long)
    return out


def chunk_columns(
    columns: PlanColumns,
    lo: int,
    hi: int,
    selected: torch.Tensor | None,
    has_cmp: bool,
    batch: int,
    device: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The core's columns of local queries ``lo:hi`` as tensors: ``(window [B, n, W],
    slots [B, n, k] or None)`` pool rows, ``-1`` = empty; slots are the indexer's picks
    (``selected``, global slot ids) or, without them, every visible slot (HCA)."""
    window = torch.as_tensor(columns.window(lo, hi), device=device).expand(batch, -1, -1)
    if selected is not None:
        sel = selected[:, lo:hi].to(device)
        return window, torch.where(sel >= 0, sel + columns.n_ext, -1)
    if not has_cmp:
        return window, None
    hca = columns.pool_rows(columns.visible_slots(lo, hi))
    return window, torch.as_tensor(hca, device=device).expand(batch, -1, -1)


def run_sparse_attention(
    q: torch.Tensor,
    ori_ext: torch.Tensor,
    cmp_kv: torch.Tensor | None,
    plan: Any,
    selected: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    *,
    kernel: str = "smallop",
    query_chunk: int = 1024,
) -> torch.Tensor:
    """Attention of the local queries over the window and the compressed slots of the plan.

    Columns keep the single-device order: the window (ascending, -1 padded to W), then the
    compressed slots (the indexer's picks for r = 4, every visible slot ascending for r = 128).

    Args:
        q: local queries ``[B, L, H, D]``.
        ori_ext: window KV in the ext frame ``[B, E, D]``.
        cmp_kv: global compressed KV ``[B, N, D]`` (slots ``0 .. N-1``), or ``None``.
        plan: the rank's :class:`hp_cp_core.plan.RankPlan`.
        selected: indexer picks ``[B, L, k]`` (global slot ids, -1 = none), or ``None``.
        sink: per-head sink logits ``[H]``.
        scale: softmax scale.
        kernel: ``"banded"`` (the window, and HCA's slots, as dense bands; only the top-k
            is gathered: :mod:`hp_cp_torch.banded`), ``"efficient"``, ``"triton"`` or
            ``"smallop"``.
        query_chunk: queries per chunk.

    Returns:
        ``[B, L, H, D]``.
    """
    columns = PlanColumns(plan, ori_ext.shape[1])
    if kernel == "banded":
        from hp_cp_torch.banded import PICKS_BAND_FACTOR, block_rows_for, sparse_attention_banded

        width = 0 if selected is None else selected.shape[-1]
        rows = block_rows_for(q.shape[0], width, q.shape[-1])
        # HCA (slots, no picks): every visible slot, as a dense band per block; CSA: the
        # picks as a masked band where the block's visible slots are few
        hca = selected is None and cmp_kv is not None
        blocks = columns.dense_blocks(
            rows, with_slots=hca, picks_band_max=PICKS_BAND_FACTOR * width
        )
        return sparse_attention_banded(q, ori_ext, cmp_kv, selected, sink, scale, blocks)
    attend = sparse_attention_smallop
    if kernel == "efficient":
        from hp_cp_torch.efficient import sparse_attention_efficient as attend
    elif kernel == "triton":
        from hp_cp_torch.triton_attention import sparse_attention_triton as attend
    pool = ori_ext if cmp_kv is None else torch.cat([ori_ext, cmp_kv], dim=1)
    outs = []
    for lo, hi in columns.chunks(query_chunk):
        window, slots = chunk_columns(
            columns, lo, hi, selected, cmp_kv is not None, q.shape[0], q.device
        )
        idx = window if slots is None else torch.cat([window, slots], dim=-1)
        outs.append(attend(q[:, lo:hi], pool, idx, sink, scale))
    return torch.cat(outs, dim=1)
