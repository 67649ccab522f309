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

__all__ = [
    "PlanColumns",
    "deterministic_topk",
    "gather_rows",
    "run_sparse_attention",
    "select_topk_chunked",
    "sparse_attention_smallop",
]


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

    ``torch.topk`` leaves the order of equal values unspecified (and device dependent); a
    stable descending sort does not, so a sequence-parallel run that scores the same
    candidate row picks the same columns.

    Args:
        scores: Scores ``[..., N]``; ``-inf`` entries are allowed (they sort last).
        k: How many to keep, ``0 <= k <= N``.

    Returns:
        ``(values, indices)``, each ``[..., k]``, in descending-score order.
    """
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def select_topk_chunked(
    score_fn: Any,
    plan: Any,
    topk: int,
    query_chunk: int,
    batch: int | None = None,
) -> torch.Tensor:
    """Indexer top-k of every local query over its visible slots only, chunk by chunk.

    A chunk of queries scores just the slot range its queries can see (the causal prefix of
    their documents), not the whole global set, so work and memory stay bounded.

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
    start = torch.as_tensor(plan.cmp_start)
    stop = start + torch.as_tensor(plan.cmp_count)
    outs = []
    for lo in range(0, plan.n_local, query_chunk):
        hi = min(lo + query_chunk, plan.n_local)
        # a query that sees no slot may have its start past the gathered slots: skip it
        seen = stop[lo:hi] > start[lo:hi]
        if not bool(seen.any()):
            outs.append(None)
            continue
        s0, s1 = int(start[lo:hi][seen].min()), int(stop[lo:hi][seen].max())
        if s1 <= s0:
            outs.append(None)
            continue
        scores = score_fn(lo, hi, s0, s1).float()
        cols = torch.arange(s0, s1, device=scores.device)
        visible = (cols >= start[lo:hi, None].to(cols.device)) & (
            cols < stop[lo:hi, None].to(cols.device)
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        values, ids = deterministic_topk(scores, min(topk, s1 - s0))
        sel = torch.where(torch.isneginf(values), -1, ids + s0)
        outs.append(torch.nn.functional.pad(sel, (0, topk - sel.shape[-1]), value=-1))
    batch = next((o.shape[0] for o in outs if o is not None), 1 if batch is None else batch)
    device = next((o.device for o in outs if o is not None), None)
    return torch.cat(
        [
            o
            if o is not None
            else torch.full(
                (batch, min(lo + query_chunk, plan.n_local) - lo, topk),
                -1,
                dtype=torch.long,
                device=device,
            )
            for o, lo in zip(outs, range(0, plan.n_local, query_chunk))
        ],
        dim=1,
    )


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
        kernel: ``"smallop"``, ``"efficient"`` or ``"triton"``.
        query_chunk: queries per chunk.

    Returns:
        ``[B, L, H, D]``.
    """
    attend = sparse_attention_smallop
    if kernel == "efficient":
        from hp_cp_torch.efficient import sparse_attention_efficient as attend
    elif kernel == "triton":
        from hp_cp_torch.triton_attention import sparse_attention_triton as attend
    pool = ori_ext if cmp_kv is None else torch.cat([ori_ext, cmp_kv], dim=1)
    columns = PlanColumns(plan, ori_ext.shape[1], cmp_kv is not None, q.shape[0], q.device)
    outs = []
    for lo, hi in columns.chunks(query_chunk):
        window, slots = columns.of(lo, hi, selected)
        idx = window if slots is None else torch.cat([window, slots], dim=-1)
        outs.append(attend(q[:, lo:hi], pool, idx, sink, scale))
    return torch.cat(outs, dim=1)


class PlanColumns:
    """The pool columns of the local queries, chunk by chunk, in the single-device order:
    window rows of the ext frame (``-1`` padded to W), then compressed slots at ``n_ext + j``
    (the indexer's picks, or every visible slot for r = 128).

    Args:
        plan: the rank's :class:`hp_cp_core.plan.RankPlan` (the index math is there).
        n_ext: rows of the window ext frame (the pool's compressed slots start after them).
        has_cmp: whether the pool holds compressed slots.
        batch: ``B``.
        device: where the index tensors go.
    """

    def __init__(self, plan: Any, n_ext: int, has_cmp: bool, batch: int, device: Any) -> None:
        from hp_cp_core.indices import window_index_dense

        self.plan, self.n_ext, self.has_cmp, self.batch = plan, n_ext, has_cmp, batch
        self.device = device
        window = window_index_dense(plan.window_start, plan.window_len, plan.spec.window_size)
        self.window = torch.as_tensor(window, device=device)

    def chunks(self, query_chunk: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` local query ranges of at most ``query_chunk`` rows."""
        n = self.plan.n_local
        return [(lo, min(lo + query_chunk, n)) for lo in range(0, n, query_chunk)]

    def of(
        self, lo: int, hi: int, selected: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(window [B, hi-lo, W], slots [B, hi-lo, k] or None)`` pool rows, ``-1`` = empty."""
        from hp_cp_core.indices import compressed_index_dense

        window = self.window[lo:hi].expand(self.batch, -1, -1)
        if selected is not None:
            sel = selected[:, lo:hi].to(self.device)
            return window, torch.where(sel >= 0, sel + self.n_ext, -1)
        if not self.has_cmp:
            return window, None
        count = self.plan.cmp_count[lo:hi]
        width = int(count.max()) if count.size else 0
        hca = compressed_index_dense(self.plan.cmp_start[lo:hi], count, width)
        hca = torch.as_tensor(hca, device=self.device)
        return window, torch.where(hca >= 0, hca + self.n_ext, -1).expand(self.batch, -1, -1)
