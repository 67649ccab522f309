"""Sparse attention with an attention sink: the small-op (gather) reference kernel.

Every query row attends to an explicit list of rows of a shared KV pool (one KV head,
K == V), plus an optional per-head *sink*: a virtual key with logit ``sink[h]`` and value 0,
so it only enters the softmax denominator. This is the DeepSeek V4 attention core, see
docs/semantics.md section 5.

The kernel here gathers the selected rows and runs the softmax in fp32. It is the exact
reference that other kernels (:mod:`hp_cp_torch.kernels`) are checked against; its memory
grows with the number of selected columns.
"""

from __future__ import annotations

import torch

from hp_cp_torch.kernels.softmax import finite_max, safe_denominator, sink_logits

__all__ = ["gather_rows", "sparse_attention_smallop"]


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
    sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attend each query to the KV-pool rows listed in ``idx``, with an optional sink.

    For query ``(b, s)`` and head ``h``, with ``s_i = scale * q[b,s,h] . kv_pool[b, idx[b,s,i]]``
    (``-inf`` where ``idx == -1``) and ``m = max(max_i s_i, sink[h])``::

        o = sum_i exp(s_i - m) kv_i / (sum_i exp(s_i - m) + exp(sink[h] - m))

    The max includes the sink (the Megatron / MindFormers form). Without a sink (``None``)
    the sink terms are left out (a sink of ``-inf``). A row whose every column is ``-1``
    gives exactly 0 and finite (zero) gradients, with or without a sink (Note [Rows that see
    nothing] in :mod:`hp_cp_torch.kernels.softmax`). Softmax math runs in fp32.

    Args:
        q: Queries ``[B, S, H, D]``.
        kv_pool: The shared KV rows ``[B, P, D]`` (keys and values are the same vectors).
        idx: Column lists ``[B, S, K]`` (int32 or int64) of rows of ``kv_pool``; ``-1``
            marks an empty column. The column order is kept (it only affects rounding).
        sink: Per-head sink logits ``[H]`` (used in fp32), or ``None``: no sink (and no
            gradient for it).
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
    sink_f = sink_logits(sink, q.shape[2], q).view(1, 1, -1, 1)  # [1, 1, H, 1]
    if logits.shape[-1] == 0:
        m = sink_f.expand(*logits.shape[:-1], 1)
    else:
        m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink_f)
    # The output does not depend on m mathematically, so it carries no gradient.
    m = finite_max(m.detach())
    p = torch.exp(logits - m)  # exp(-inf) = 0 for empty columns
    denom = safe_denominator(p.sum(dim=-1, keepdim=True) + torch.exp(sink_f - m))
    return torch.einsum("bshk,bskd->bshd", p / denom, kv_sel).to(q.dtype)
