"""Sparse attention with a sink that runs the window as dense bands and gathers only the top-k.

:func:`sparse_attention_banded` computes what
:func:`hp_cp_torch.attention.sparse_attention_smallop` computes for the pool
``[kv_ext ; cmp_kv]`` and the columns "window, then slots", with the window given as the
dense bands the core plans (:meth:`hp_cp_core.columns.PlanColumns.window_bands`).

Note [Band plus gather, one softmax]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The window of consecutive queries is a band of consecutive ext rows, so a block of queries
reads one contiguous slice of ``kv_ext`` (no gather) and its logits are one matrix product;
only the compressed top-k columns differ per query and are gathered::

               band keys k0 .. k1 (a slice of kv_ext)     gathered slots (per query)
    query lo   x x x x . . . .                            s s s s s s
    query lo+1 . x x x x . . .          masked: '.'       s s s s s s
    query hi-1 . . . . x x x x                            s s s s s s

Both parts share one softmax with the sink: with ``m = max(max band logit, max slot logit,
sink)`` (exactly the small-op kernel's max),
``denom = sum exp(band - m) + sum exp(slots - m) + exp(sink - m)`` and
``o = (P_band V_band + P_slots V_slots) / denom``; the forward keeps only
``lse = m + log(denom)`` per (row, head) and backward recomputes ``p = exp(logit - lse)``
block by block (as :mod:`hp_cp_torch.efficient` does), so saved memory does not grow with
the number of columns. In backward the band's KV gradient is a dense product added to a
slice of ``d kv_ext``; only the top-k part scatters (``index_add_``, duplicates add up).
Masked band keys and ``-1`` slots have ``p = 0``: they add nothing anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hp_cp_core.columns import WindowBand

__all__ = ["BLOCK_ROWS", "GATHER_BUDGET_BYTES", "block_rows_for", "sparse_attention_banded"]

BLOCK_ROWS = 64
"""Most query rows of one band block."""

GATHER_BUDGET_BYTES = 32 << 20
"""Upper bound on one block's fp32 top-k gather ``[B, rows, K, D]`` (bytes)."""


def block_rows_for(batch: int, k: int, dim: int) -> int:
    """Query rows per band block: at most :data:`BLOCK_ROWS`, and few enough that the block's
    top-k gather stays under :data:`GATHER_BUDGET_BYTES` (at least 8 rows)."""
    per_row = max(batch * k * dim * 4, 1)
    return max(1, min(BLOCK_ROWS, max(8, GATHER_BUDGET_BYTES // per_row)))


class _Block:
    """One band block's tensors: fp32 queries, band keys, gathered slots, their masks."""

    def __init__(self, q, kv_ext, cmp, idx, band: WindowBand, mask, scale: float) -> None:
        b, n, h, d = q.shape[0], band.hi - band.lo, q.shape[2], q.shape[3]
        self.shape = (b, n, h)
        self.q = q[:, band.lo : band.hi].float()  # [B, n, H, D]
        self.kw = kv_ext[:, band.key_start : band.key_stop].float()  # [B, nb, D]
        self.band_mask = mask  # [n, nb] bool
        lw = torch.matmul(self.q.reshape(b, n * h, d), self.kw.transpose(1, 2)) * scale
        self.lw = lw.view(b, n, h, -1).masked_fill(~mask[None, :, None, :], float("-inf"))
        self.k = idx.shape[-1]
        self.kc = self.lc = None
        if self.k:
            sel = idx[:, band.lo : band.hi].long()  # [B, n, K]
            self.valid = sel >= 0
            self.rows = (
                sel.clamp(min=0)
                + (torch.arange(b, device=sel.device) * cmp.shape[1]).view(-1, 1, 1)
            ).reshape(-1)
            kc = cmp.reshape(-1, d).index_select(0, self.rows).float()
            self.kc = kc.view(b * n, self.k, d)
            lc = torch.matmul(self.q.reshape(b * n, h, d), self.kc.transpose(1, 2)) * scale
            self.lc = lc.view(b, n, h, self.k).masked_fill(
                ~self.valid[:, :, None, :], float("-inf")
            )

    def values(self, pw: torch.Tensor, pc: torch.Tensor | None) -> torch.Tensor:
        """``P_band V_band + P_slots V_slots``: ``[B, n, H, D]`` fp32."""
        b, n, h = self.shape
        o = torch.matmul(pw.reshape(b, n * h, -1), self.kw).view(b, n, h, -1)
        if pc is not None:
            o = o + torch.matmul(pc.reshape(b * n, h, self.k), self.kc).view(b, n, h, -1)
        return o


class _BandedSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kv_ext: torch.Tensor,
        cmp_kv: torch.Tensor,
        idx: torch.Tensor,
        sink: torch.Tensor,
        scale: float,
        bands: Sequence[WindowBand],
    ) -> torch.Tensor:
        batch, seq, heads, dim = q.shape
        idx = idx.expand(batch, -1, -1)
        cmp = cmp_kv if cmp_kv.shape[1] else cmp_kv.new_zeros(batch, 1, dim)
        masks = [torch.as_tensor(b.mask, device=q.device) for b in bands]
        sink_f = sink.detach().float().view(1, 1, -1, 1)
        out = q.new_empty(q.shape)
        lse = torch.empty(batch, seq, heads, dtype=torch.float32, device=q.device)
        for band, mask in zip(bands, masks):
            blk = _Block(q, kv_ext, cmp, idx, band, mask, scale)
            m = torch.maximum(blk.lw.amax(dim=-1, keepdim=True), sink_f)
            if blk.k:
                m = torch.maximum(m, blk.lc.amax(dim=-1, keepdim=True))
            pw = torch.exp(blk.lw - m)
            denom = pw.sum(dim=-1, keepdim=True) + torch.exp(sink_f - m)
            pc = None
            if blk.k:
                pc = torch.exp(blk.lc - m)
                denom = denom + pc.sum(dim=-1, keepdim=True)
            out[:, band.lo : band.hi] = (blk.values(pw, pc) / denom).to(q.dtype)
            lse[:, band.lo : band.hi] = (m + torch.log(denom)).squeeze(-1)
        small = cmp.shape[1] < 2**31 - 1
        ctx.save_for_backward(q, kv_ext, cmp_kv, idx.int() if small else idx.long(), sink, lse)
        ctx.scale, ctx.bands, ctx.masks = float(scale), bands, masks
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, kv_ext, cmp_kv, idx, sink, lse = ctx.saved_tensors
        scale = ctx.scale
        batch, _, heads, dim = q.shape
        need_q, need_ext, need_cmp, _, need_sink, _, _ = ctx.needs_input_grad
        cmp = cmp_kv if cmp_kv.shape[1] else cmp_kv.new_zeros(batch, 1, dim)
        d_ext = torch.zeros(kv_ext.shape, dtype=torch.float32, device=q.device)
        d_cmp = torch.zeros(cmp.shape, dtype=torch.float32, device=q.device)
        d_q = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_q else None
        d_sink = torch.zeros(heads, dtype=torch.float32, device=q.device)
        sink_f = sink.detach().float().view(1, 1, -1)
        for band, mask in zip(ctx.bands, ctx.masks):
            blk = _Block(q, kv_ext, cmp, idx, band, mask, scale)
            b, n, h = blk.shape
            lse_c = lse[:, band.lo : band.hi]
            go = grad_out[:, band.lo : band.hi].float()  # [B, n, H, D]
            pw = torch.exp(blk.lw - lse_c[..., None])  # [B, n, H, nb]
            dpw = torch.matmul(go.reshape(b, n * h, dim), blk.kw.transpose(1, 2)).view(pw.shape)
            delta = (pw * dpw).sum(dim=-1)  # [B, n, H] = dO . o
            pc = dpc = None
            if blk.k:
                pc = torch.exp(blk.lc - lse_c[..., None])  # [B, n, H, K]
                dpc = torch.matmul(go.reshape(b * n, h, dim), blk.kc.transpose(1, 2))
                dpc = dpc.view(pc.shape)
                delta = delta + (pc * dpc).sum(dim=-1)
            dsw = pw * (dpw - delta[..., None])
            d_sink -= (torch.exp(sink_f - lse_c) * delta).sum(dim=(0, 1))
            dsc = None if pc is None else pc * (dpc - delta[..., None])
            if need_q:
                d_q[:, band.lo : band.hi] = (blk.values(dsw, dsc) * scale).to(q.dtype)
            # both roles of each key (value: p dO, key: scale ds q) in one product
            rhs = torch.cat([go, blk.q * scale], dim=2)  # [B, n, 2H, D]
            if need_ext:
                lhs = torch.cat([pw, dsw], dim=2).reshape(b, 2 * n * h, -1)
                d_ext[:, band.key_start : band.key_stop] += torch.matmul(
                    lhs.transpose(1, 2), rhs.reshape(b, 2 * n * h, dim)
                )
            if need_cmp and blk.k:
                lhs = torch.cat([pc, dsc], dim=2).reshape(b * n, 2 * h, blk.k)
                d_sel = torch.matmul(lhs.transpose(1, 2), rhs.reshape(b * n, 2 * h, dim))
                d_cmp.view(-1, dim).index_add_(0, blk.rows, d_sel.reshape(-1, dim))
            del blk, pw, dpw, pc, dpc, dsw, dsc
        return (
            d_q,
            d_ext.to(kv_ext.dtype) if need_ext else None,
            d_cmp[:, : cmp_kv.shape[1]].to(cmp_kv.dtype) if need_cmp else None,
            None,
            d_sink.to(sink.dtype) if need_sink else None,
            None,
            None,
        )


def sparse_attention_banded(
    q: torch.Tensor,
    kv_ext: torch.Tensor,
    cmp_kv: torch.Tensor | None,
    idx: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    bands: Sequence[WindowBand],
) -> torch.Tensor:
    """Attention of every query to its window band and its compressed slots, with a sink.

    Equal (up to rounding) to :func:`hp_cp_torch.attention.sparse_attention_smallop` on the
    pool ``[kv_ext ; cmp_kv]`` with columns "window, then ``n_ext + idx``"; see Note [Band
    plus gather, one softmax].

    Args:
        q: Queries ``[B, L, H, D]``.
        kv_ext: Window KV rows (the ext frame) ``[B, E, D]``.
        cmp_kv: Compressed KV slots ``[B, N, D]``, or ``None``.
        idx: Slot columns ``[B or 1, L, K]`` (rows of ``cmp_kv``, ``-1`` = empty), or ``None``.
        sink: Per-head sink logits ``[H]``.
        scale: Softmax scale.
        bands: The window bands covering every query ``0 .. L-1`` exactly once
            (:meth:`hp_cp_core.columns.PlanColumns.window_bands`).

    Returns:
        ``[B, L, H, D]`` in ``q``'s dtype.
    """
    batch, seq, _, dim = q.shape
    if cmp_kv is None:
        cmp_kv = kv_ext.new_zeros(batch, 0, dim)
    if idx is None:
        idx = torch.full((1, seq, 0), -1, dtype=torch.long, device=q.device)
    return _BandedSparseAttention.apply(q, kv_ext, cmp_kv, idx, sink, scale, tuple(bands))
