"""Sparse attention with an optional sink whose saved activations do not grow with the
selected keys.

:func:`sparse_attention_efficient` computes exactly what
:func:`hp_cp_torch.kernels.smallop.sparse_attention_smallop` computes (same arguments, same
semantics, fp32 softmax), as one ``torch.autograd.Function``:

* forward runs over chunks of query rows; a chunk gathers its selected KV rows
  ``[B, rows, K, D]``, produces its output and the per-(row, head) log-sum-exp
  ``lse = m + log(sum_i exp(s_i - m) + exp(sink - m))``, and drops the gathered rows;
* only ``q``, ``kv_pool``, ``idx`` (int32 when the pool allows) and ``lse`` (fp32,
  ``[B, S, H]``) are saved for backward. No ``[rows, K, D]`` tensor outlives its chunk, so
  the saved bytes grow with K only by the index list itself (4 bytes per column instead of
  ``4 * D`` for the gathered rows plus the fp32 probabilities of the small-op path);
* backward recomputes each chunk's gather and probabilities ``p_i = exp(s_i - lse)`` and
  accumulates the KV-pool gradient with ``index_add_`` (duplicate columns add up, as in the
  small-op path). With ``dp_i = dO . v_i`` and ``delta = sum_i p_i dp_i = dO . o``::

      ds_i  = p_i (dp_i - delta)
      dq    = scale * sum_i ds_i v_i
      dv_i  = sum_h (p_i dO + scale * ds_i q)        (K == V: one pool row, both roles)
      dsink = -sum_{b,s} exp(sink - lse) * delta

A row whose every column is ``-1`` has ``lse = sink`` (``+inf`` without a sink), output 0
and zero gradients, like the small-op path (Note [Rows that see nothing] in
:mod:`hp_cp_torch.kernels.softmax`). Without a sink (``None``) the sink terms are left out
and it gets no gradient. The chunk height is chosen so a chunk's gather stays under
``GATHER_BUDGET_BYTES`` (at most ``MAX_CHUNK_ROWS`` rows).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_cp_torch.kernels.smallop import gather_rows
from hp_cp_torch.kernels.softmax import (
    finite_max,
    row_lse,
    safe_denominator,
    sink_gradient,
    sink_logits,
)

__all__ = ["GATHER_BUDGET_BYTES", "MAX_CHUNK_ROWS", "sparse_attention_efficient"]

GATHER_BUDGET_BYTES = 16 << 20
"""Upper bound on one chunk's fp32 gather ``[B, rows, K, D]`` (bytes)."""

MAX_CHUNK_ROWS = 256
"""Most query rows per chunk."""


def _chunk_rows(batch: int, k: int, dim: int) -> int:
    per_row = max(batch * k * dim * 4, 1)
    return max(1, min(MAX_CHUNK_ROWS, GATHER_BUDGET_BYTES // per_row))


def _gather(kv_pool: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_sel [B, n, K, D] fp32, valid [B, n, K])`` for one chunk of ``idx``."""
    idx = idx.long()
    return gather_rows(kv_pool, idx.clamp(min=0)).float(), idx >= 0


def _logits(q: torch.Tensor, kv_sel: torch.Tensor, valid: torch.Tensor, scale: float):
    logits = torch.einsum("bshd,bskd->bshk", q.float(), kv_sel) * scale
    return logits.masked_fill(~valid[:, :, None, :], float("-inf"))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kv_pool: torch.Tensor,
        idx: torch.Tensor,
        sink: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        batch, seq, heads, dim = q.shape
        idx = idx.expand(batch, -1, -1)
        k = idx.shape[-1]
        # nothing to gather from (no pool row): every column must be -1
        pool = kv_pool if kv_pool.shape[1] else kv_pool.new_zeros(batch, 1, dim)
        sink_f = sink_logits(sink, heads, q).detach().view(1, 1, -1, 1)
        out = q.new_empty(q.shape)
        lse = torch.empty(batch, seq, heads, dtype=torch.float32, device=q.device)
        step = _chunk_rows(batch, k, dim)
        for lo in range(0, seq, step):
            hi = min(lo + step, seq)
            kv_sel, valid = _gather(pool, idx[:, lo:hi])
            logits = _logits(q[:, lo:hi], kv_sel, valid, scale)
            if k == 0:
                m = sink_f.expand(batch, hi - lo, heads, 1)
            else:
                m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink_f)
            m = finite_max(m)
            p = torch.exp(logits - m)
            denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink_f - m)
            probs = p / safe_denominator(denom)
            out[:, lo:hi] = torch.einsum("bshk,bskd->bshd", probs, kv_sel).to(q.dtype)
            lse[:, lo:hi] = row_lse(m, denom).squeeze(-1)
            del kv_sel, logits, p
        small = kv_pool.shape[1] < 2**31 - 1
        ctx.save_for_backward(q, kv_pool, idx.int() if small else idx.long(), sink, lse)
        ctx.scale = float(scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, kv_pool, idx, sink, lse = ctx.saved_tensors
        scale = ctx.scale
        batch, seq, heads, dim = q.shape
        k = idx.shape[-1]
        need_q, need_kv, _, need_sink, _ = ctx.needs_input_grad
        pool = kv_pool if kv_pool.shape[1] else kv_pool.new_zeros(batch, 1, dim)
        d_pool = torch.zeros(pool.shape, dtype=torch.float32, device=pool.device)
        d_q = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_q else None
        d_sink = torch.zeros(heads, dtype=torch.float32, device=q.device)
        flat_pool = d_pool.view(-1, dim)
        step = _chunk_rows(batch, k, dim)
        for lo in range(0, seq, step):
            hi = min(lo + step, seq)
            qc, go, lse_c = q[:, lo:hi].float(), grad_out[:, lo:hi].float(), lse[:, lo:hi]
            kv_sel, valid = _gather(pool, idx[:, lo:hi])
            p = torch.exp(_logits(qc, kv_sel, valid, scale) - lse_c[..., None])  # [B,n,H,K]
            dp = torch.einsum("bshd,bskd->bshk", go, kv_sel)
            delta = (p * dp).sum(dim=-1)  # [B, n, H] = dO . o
            ds = p * (dp - delta[..., None])
            d_sink += sink_gradient(sink, lse_c, delta)
            if need_q:
                d_q[:, lo:hi] = (torch.einsum("bshk,bskd->bshd", ds, kv_sel) * scale).to(q.dtype)
            if need_kv and k:
                # both roles of each pool row (value: p dO, key: scale ds q) in one product
                d_sel = torch.einsum(
                    "bshk,bshd->bskd", torch.cat([p, ds], 2), torch.cat([go, qc * scale], 2)
                )
                # empty columns point at row 0 with zero p and ds: they add nothing
                base = torch.arange(batch, device=idx.device) * pool.shape[1]
                rows = idx[:, lo:hi].long().clamp(min=0) + base[:, None, None]
                flat_pool.index_add_(0, rows.reshape(-1), d_sel.reshape(-1, dim))
            del kv_sel, p, dp, ds
        d_kv = d_pool[:, : kv_pool.shape[1]].to(kv_pool.dtype) if need_kv else None
        return d_q, d_kv, None, d_sink.to(sink.dtype) if need_sink else None, None


def sparse_attention_efficient(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attend each query to the KV-pool rows listed in ``idx``, with an optional sink.

    Same arguments, result and gradients as
    :func:`hp_cp_torch.kernels.smallop.sparse_attention_smallop`; chunked over queries and
    recomputed in backward, so memory does not grow with the number of selected keys (see
    the module docstring).
    """
    return _SparseAttention.apply(q, kv_pool, idx, sink, scale)
