"""Sparse attention with an optional sink that runs the window as dense bands and gathers
only the top-k.

:func:`sparse_attention_banded` computes what
:func:`hp_cp_torch.kernels.smallop.sparse_attention_smallop` computes for the pool
``[kv_ext ; cmp_kv]`` and the columns "window, then slots", with the window given as the
dense bands the core plans (:meth:`hp_cp_core.columns.PlanColumns.dense_blocks`).

Note [Band plus gather, one softmax]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The window of consecutive queries is a band of consecutive ext rows, so a block of queries
reads one contiguous slice of ``kv_ext`` (no gather) and its logits are one matrix product
(HCA's visible slots are such a band of ``cmp_kv`` too); only the indexer's top-k columns
differ per query and are gathered::

               band keys k0 .. k1 (a slice of kv_ext)     gathered slots (per query)
    query lo   x x x x . . . .                            s s s s s s
    query lo+1 . x x x x . . .          masked: '.'       s s s s s s
    query hi-1 . . . . x x x x                            s s s s s s

Where a block's visible slots are few (at most :data:`PICKS_BAND_FACTOR` times the top-k:
early positions of a sequence), the core plans the picks as a band too
(``DenseBlock.picks_in_band``): the block reads that slice of ``cmp_kv`` and weighs each
column by how often the query picked it, one dense product instead of a ``[rows, K, D]``
gather and ``rows`` small ones. The weight is a logit bias, ``log(count)``: ``-inf`` for a
column not picked (masked), ``0`` for one pick, ``log 2`` for a slot picked twice (never the
indexer's top-k, but a caller's pick list may repeat), so ``exp(logit + log c) = c exp(logit)``
adds repeats up exactly as the small-op kernel's gather does, with no host read to find them.
The counts are integers of at most K, so the bias is a lookup in a ``K + 1`` table of logs
built once per call, not a ``log`` over every block's counts (see :data:`PICK_READS`).

All parts share one softmax with the sink: with ``m = max(max band logit, max slot logit,
sink)`` (exactly the small-op kernel's max),
``denom = sum exp(band - m) + sum exp(slots - m) + exp(sink - m)`` and
``o = (P_band V_band + P_slots V_slots) / denom``; the forward keeps only
``lse = m + log(denom)`` per (row, head) and backward recomputes ``p = exp(logit - lse)``
block by block (as :mod:`hp_cp_torch.kernels.efficient` does), so saved memory does not grow with
the number of columns. Without a sink the sink terms are left out, and a row that sees
nothing gives 0 with zero gradients (Note [Rows that see nothing] in
:mod:`hp_cp_torch.kernels.softmax`). In backward the band's KV gradient is a dense product
added to a slice of ``d kv_ext``; only the top-k part scatters (``index_add_``, duplicates add up).
Masked band keys and ``-1`` slots have ``p = 0``: they add nothing anywhere. The logits and
``dO V^T`` are fp32 products; the weighted sums and the gradient products round their
weights, output gradients and queries to the inputs' dtype and multiply there (bf16 products
run 2-4x fp32's on a CPU with AVX512-BF16), as flash attention does; fp32 inputs are
unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hp_cp_core.columns import DenseBlock
from hp_cp_torch.kernels.softmax import (
    finite_max,
    rounded,
    row_lse,
    safe_denominator,
    sink_gradient,
    sink_logits,
)

__all__ = [
    "BLOCK_ROWS",
    "GATHER_BUDGET_BYTES",
    "PICKS_BAND_FACTOR",
    "PICK_READS",
    "block_rows_for",
    "sparse_attention_banded",
]

BLOCK_ROWS = 64
"""Most query rows of one band block."""

GATHER_BUDGET_BYTES = 32 << 20
"""Upper bound on one block's fp32 top-k gather ``[B, rows, K, D]`` (bytes)."""


PICKS_BAND_FACTOR = 2
"""A block reads its indexer picks as a masked band of slots (no gather) when that band is at
most this many times the top-k wide: a dense product over ``2 K`` columns runs faster on a CPU
than a per-query gather and product over ``K``."""


PICK_READS = ("weights", "log_weights", "mask")
"""How a block reads picks that lie in its slot band (``picks=`` of
:func:`sparse_attention_banded`); all three give the small-op kernel's result:

* ``"weights"`` (the default): each column's pick count as a ``log(count)`` logit bias,
  looked up in a table of logs (Note [Band plus gather, one softmax]); no host read;
* ``"log_weights"``: the same bias by a ``log`` of each block's counts (0.2.0's kernel after
  repeats were weighted; on a 2-core CPU that ``log`` costs more than the lookup);
* ``"mask"``: a boolean mask and one host read per block to find a repeated pick; a block
  with a repeat is gathered instead (the kernel before repeats were weighted).

The benchmark (:mod:`hp_cp_torch.bench.kernel`) measures each of them in one run."""


def block_rows_for(batch: int, k: int, dim: int) -> int:
    """Query rows per band block: at most :data:`BLOCK_ROWS`, and few enough that the block's
    top-k gather stays under :data:`GATHER_BUDGET_BYTES` (at least 8 rows)."""
    per_row = max(batch * k * dim * 4, 1)
    return max(1, min(BLOCK_ROWS, max(8, GATHER_BUDGET_BYTES // per_row)))


class _Workspace:
    """Reusable buffers of one forward or backward call. A block's top-k gather and its
    KV-gradient product are tens of MiB; a fresh tensor that large is new pages on every
    block, and on a CPU their faults cost more than the copy itself."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        like: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """A ``shape`` view of buffer ``name`` on ``like``'s device (grown when too small;
        contents undefined)."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def log_counts(self, k: int, like: torch.Tensor) -> torch.Tensor:
        """``[k + 1]`` fp32, ``log(c)`` at ``c``: the logit bias of a column picked ``c``
        times (``-inf`` at 0, ``0`` at 1), for picks lists of ``k`` columns (built once)."""
        table = self._buffers.get("log_counts")
        if table is None or table.numel() < k + 1:
            table = torch.arange(k + 1, dtype=torch.float32, device=like.device).log()
            self._buffers["log_counts"] = table
        return table


def _pick_counts(sel: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, n, stop - start + 1]``: how often ``sel`` ``[B, n, K]`` (global slots, ``-1`` =
    none) picks each band column; the spare last column counts the picks that are none or
    outside the band (dropped by the callers)."""
    width = stop - start
    inside = (sel >= start) & (sel < stop)
    column = torch.where(inside, sel - start, width)
    counts = torch.zeros(*sel.shape[:2], width + 1, dtype=dtype, device=sel.device)
    one = torch.ones((), dtype=dtype, device=sel.device).expand(column.shape)
    return counts.scatter_add_(2, column, one)


def _picks_bias(
    sel: torch.Tensor, start: int, stop: int, log_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, n, stop - start]`` fp32: ``log(times picked)`` of each band column by ``sel``
    ``[B, n, K]`` (global slots, ``-1`` = none): ``-inf`` where not picked, ``log 2`` where
    picked twice. Added to the band's logits it weighs each column by its pick count, as the
    gather would (Note [Band plus gather, one softmax]); no host read. ``log_counts``: the
    table of :meth:`_Workspace.log_counts` (built here when not given). The planner's band
    holds every slot the block's queries see, so every pick lands in it (one outside would
    count in the spare column, dropped)."""
    if log_counts is None:
        log_counts = torch.arange(sel.shape[-1] + 1, dtype=torch.float32, device=sel.device).log()
    counts = _pick_counts(sel, start, stop, torch.int64)
    bias = log_counts.index_select(0, counts.view(-1)).view(counts.shape)
    return bias[..., : stop - start]


def _picks_log_bias(sel: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """:func:`_picks_bias` by a ``log`` of the counts (``PICK_READS`` ``"log_weights"``)."""
    return _pick_counts(sel, start, stop, torch.float32)[..., : stop - start].log()


def _picks_mask(sel: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
    """``[B, n, stop - start]``: True at each pick of ``sel`` inside the band, or ``None``
    when a pick lies outside it or repeats (a mask cannot count a column twice; such blocks
    are gathered, where repeats add up). One host read (``PICK_READS`` ``"mask"``)."""
    width = stop - start
    valid = sel >= 0
    inside = valid & (sel >= start) & (sel < stop)
    column = torch.where(inside, sel - start, width)  # outside: a spare last column
    mask = torch.zeros(*sel.shape[:2], width + 1, dtype=torch.bool, device=sel.device)
    mask.scatter_(2, column, True)
    mask = mask[..., :width]
    return mask if int(mask.sum()) == int(valid.sum()) else None


def _read_picks(
    picks: str, sel: torch.Tensor, blk: DenseBlock, ws: _Workspace
) -> torch.Tensor | None:
    """The band's bias (fp32) or mask (bool) for the picks ``sel`` of block ``blk``, read as
    ``picks`` says (:data:`PICK_READS`), or ``None``: gather them."""
    if picks == "weights":
        return _picks_bias(sel, blk.slot_start, blk.slot_stop, ws.log_counts(sel.shape[-1], sel))
    if picks == "log_weights":
        return _picks_log_bias(sel, blk.slot_start, blk.slot_stop)
    return _picks_mask(sel, blk.slot_start, blk.slot_stop)


class _Block:
    """One block's fp32 queries and logits: dense parts (the window band; HCA's slot band or
    the band CSA's picks lie in), each a slice of its pool with a mask, and the gathered top-k
    part (only when the picks are not read as a band)."""

    def __init__(
        self, q, kv_ext, cmp, idx, blk: DenseBlock, masks, scale, ws: _Workspace, picks: str
    ):
        b, n, h, d = q.shape[0], blk.hi - blk.lo, q.shape[2], q.shape[3]
        self.shape = (b, n, h)
        self.q = q[:, blk.lo : blk.hi].float()  # [B, n, H, D]
        ranges = [(kv_ext, blk.key_start, blk.key_stop, masks[0])]
        if len(masks) > 1:  # the block has a slot mask (HCA)
            ranges.append((cmp, blk.slot_start, blk.slot_stop, masks[1]))
        self.k = idx.shape[-1]
        if self.k:
            sel = idx[:, blk.lo : blk.hi].long()  # [B, n, K]
            weights = _read_picks(picks, sel, blk, ws) if blk.picks_in_band else None
            if weights is not None:  # a mask, or a bias: log of each column's pick count
                ranges.append((cmp, blk.slot_start, blk.slot_stop, weights))
                self.k = 0
        q2 = self.q.reshape(b, n * h, d)
        self.dense = []  # (keys [B, nb, D], logits [B, n, H, nb], pool, start)
        self.keys_in = []  # each dense part's keys in the inputs' dtype (a slice of its pool)
        for pool, k0, k1, mask in ranges:
            self.keys_in.append(pool[:, k0:k1])
            keys = self.keys_in[-1].float()
            logits = (torch.matmul(q2, keys.transpose(1, 2)) * scale).view(b, n, h, -1)
            if mask.dtype == torch.bool:
                logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
            else:  # picks: log of each column's pick count
                logits = logits + mask[:, :, None, :]
            self.dense.append((keys, logits, pool, k0))
        self.kc = self.kc_in = self.lc = None
        if self.k:
            base = torch.arange(b, device=sel.device).view(-1, 1, 1) * cmp.shape[1]
            self.rows = (sel.clamp(min=0) + base).reshape(-1)
            flat = cmp.reshape(-1, d)
            shape = (b * n * self.k, d)
            kc = torch.index_select(flat, 0, self.rows, out=ws.get("kc", shape, q, flat.dtype))
            self.kc_in = kc.view(b * n, self.k, d)
            if kc.dtype != torch.float32:
                kc = ws.get("kc32", shape, q).copy_(kc)
            self.kc = kc.view(b * n, self.k, d)
            lc = torch.matmul(self.q.reshape(b * n, h, d), self.kc.transpose(1, 2)) * scale
            self.lc = lc.view(b, n, h, self.k).masked_fill(
                ~(sel >= 0)[:, :, None, :], float("-inf")
            )

    def logits(self) -> list[torch.Tensor]:
        """Every part's logits ``[B, n, H, *]``: the dense parts, then the gathered one."""
        return [lg for _, lg, _, _ in self.dense] + ([self.lc] if self.k else [])

    def values(self, probs: list[torch.Tensor]) -> torch.Tensor:
        """``sum over parts of P V``: ``[B, n, H, D]`` fp32 (``probs`` as :meth:`logits`), each
        product in the inputs' dtype (:func:`~hp_cp_torch.kernels.softmax.rounded`)."""
        b, n, h = self.shape
        out = None
        for keys, p in zip(self.keys_in, probs):
            o = torch.matmul(rounded(p, keys).reshape(b, n * h, -1), keys).view(b, n, h, -1)
            out = o.float() if out is None else out + o
        if self.k:
            pc = rounded(probs[len(self.dense)], self.kc_in).reshape(b * n, h, self.k)
            out = out + torch.matmul(pc, self.kc_in).view(b, n, h, -1)
        return out


def _masks(blk: DenseBlock, device: Any) -> list[torch.Tensor]:
    """One block's planned masks as ``[1, n, width]`` tensors (window, then HCA slots), built
    when the block runs and dropped after it: all blocks' masks at once would be ``[L, S / r]``
    for HCA (Note [Masks on demand] in :mod:`hp_cp_core.columns`)."""
    masks = [torch.as_tensor(blk.mask, device=device)[None]]
    slot_mask = blk.slot_mask
    if slot_mask is not None:
        masks.append(torch.as_tensor(slot_mask, device=device)[None])
    return masks


class _BandedSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kv_ext: torch.Tensor,
        cmp_kv: torch.Tensor,
        idx: torch.Tensor,
        sink: torch.Tensor | None,
        scale: float,
        blocks: Sequence[DenseBlock],
        picks: str,
    ) -> torch.Tensor:
        batch, seq, heads, dim = q.shape
        idx = idx.expand(batch, -1, -1)
        cmp = cmp_kv if cmp_kv.shape[1] else cmp_kv.new_zeros(batch, 1, dim)
        sink_f = sink_logits(sink, heads, q).detach().view(1, 1, -1, 1)
        out = q.new_empty(q.shape)
        lse = torch.empty(batch, seq, heads, dtype=torch.float32, device=q.device)
        ws = _Workspace()
        for blk in blocks:
            parts = _Block(q, kv_ext, cmp, idx, blk, _masks(blk, q.device), scale, ws, picks)
            logits = parts.logits()
            m = sink_f
            for lg in logits:
                m = torch.maximum(m, lg.amax(dim=-1, keepdim=True))
            m = finite_max(m)
            probs = [torch.exp(lg - m) for lg in logits]
            denom = torch.exp(sink_f - m)
            for p in probs:
                denom = denom + p.sum(dim=-1, keepdim=True)
            out[:, blk.lo : blk.hi] = (parts.values(probs) / safe_denominator(denom)).to(q.dtype)
            lse[:, blk.lo : blk.hi] = row_lse(m, denom).squeeze(-1)
        small = cmp.shape[1] < 2**31 - 1
        ctx.save_for_backward(q, kv_ext, cmp_kv, idx.int() if small else idx.long(), sink, lse)
        ctx.scale, ctx.blocks, ctx.picks = float(scale), blocks, picks
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, kv_ext, cmp_kv, idx, sink, lse = ctx.saved_tensors
        scale = ctx.scale
        batch, _, heads, dim = q.shape
        need_q, need_ext, need_cmp, _, need_sink, _, _, _ = ctx.needs_input_grad
        cmp = cmp_kv if cmp_kv.shape[1] else cmp_kv.new_zeros(batch, 1, dim)
        grads = {
            id(kv_ext): torch.zeros(kv_ext.shape, dtype=torch.float32, device=q.device),
            id(cmp): torch.zeros(cmp.shape, dtype=torch.float32, device=q.device),
        }
        wanted = {id(kv_ext): need_ext, id(cmp): need_cmp}
        d_q = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_q else None
        d_sink = torch.zeros(heads, dtype=torch.float32, device=q.device)
        ws = _Workspace()
        for blk in ctx.blocks:
            parts = _Block(q, kv_ext, cmp, idx, blk, _masks(blk, q.device), scale, ws, ctx.picks)
            b, n, h = parts.shape
            lse_c = lse[:, blk.lo : blk.hi]
            go = grad_out[:, blk.lo : blk.hi].float()  # [B, n, H, D]
            probs = [torch.exp(lg - lse_c[..., None]) for lg in parts.logits()]
            dps = [
                torch.matmul(go.reshape(b, n * h, dim), keys.transpose(1, 2)).view(p.shape)
                for (keys, _, _, _), p in zip(parts.dense, probs)
            ]
            if parts.k:
                dpc = torch.matmul(go.reshape(b * n, h, dim), parts.kc.transpose(1, 2))
                dps.append(dpc.view(probs[-1].shape))
            delta = sum((p * dp).sum(dim=-1) for p, dp in zip(probs, dps))  # dO . o
            dss = [p * (dp - delta[..., None]) for p, dp in zip(probs, dps)]
            d_sink += sink_gradient(sink, lse_c, delta)
            if need_q:
                d_q[:, blk.lo : blk.hi] = (parts.values(dss) * scale).to(q.dtype)
            # both roles of each key (value: p dO, key: scale ds q) in one product
            rhs32 = torch.cat([go, parts.q * scale], dim=2)  # [B, n, 2H, D]
            rhs = rounded(rhs32, kv_ext)
            for (_, _, pool, k0), p, ds in zip(parts.dense, probs, dss):
                if wanted[id(pool)]:
                    lhs = rounded(torch.cat([p, ds], dim=2), rhs).reshape(b, 2 * n * h, -1)
                    grads[id(pool)][:, k0 : k0 + lhs.shape[-1]] += torch.matmul(
                        lhs.transpose(1, 2), rhs.reshape(b, 2 * n * h, dim)
                    )
            if need_cmp and parts.k:
                # fp32: the product lands in a reused fp32 buffer for index_add_ (a bf16 one
                # would need a second buffer, or a fresh fp32 copy per block)
                lhs = torch.cat([probs[-1], dss[-1]], dim=2).reshape(b * n, 2 * h, parts.k)
                d_sel = torch.matmul(
                    lhs.transpose(1, 2),
                    rhs32.reshape(b * n, 2 * h, dim),
                    out=ws.get("d_sel", (b * n, parts.k, dim), q),
                )
                grads[id(cmp)].view(-1, dim).index_add_(0, parts.rows, d_sel.reshape(-1, dim))
            del parts, probs, dps, dss
        d_cmp = grads[id(cmp)][:, : cmp_kv.shape[1]]
        return (
            d_q,
            grads[id(kv_ext)].to(kv_ext.dtype) if need_ext else None,
            d_cmp.to(cmp_kv.dtype) if need_cmp else None,
            None,
            d_sink.to(sink.dtype) if need_sink else None,
            None,
            None,
            None,
        )


def sparse_attention_banded(
    q: torch.Tensor,
    kv_ext: torch.Tensor,
    cmp_kv: torch.Tensor | None,
    idx: torch.Tensor | None,
    sink: torch.Tensor | None,
    scale: float,
    blocks: Sequence[DenseBlock],
    *,
    picks: str = "weights",
) -> torch.Tensor:
    """Attention of every query to its window band and its compressed slots, with an optional
    sink.

    Equal (up to rounding) to :func:`hp_cp_torch.kernels.smallop.sparse_attention_smallop` on the
    pool ``[kv_ext ; cmp_kv]`` with columns "window, then ``n_ext + idx``"; see Note [Band
    plus gather, one softmax].

    Args:
        q: Queries ``[B, L, H, D]``.
        kv_ext: Window KV rows (the ext frame) ``[B, E, D]``.
        cmp_kv: Compressed KV slots ``[B, N, D]``, or ``None``.
        idx: Gathered slot columns ``[B or 1, L, K]`` (rows of ``cmp_kv``, ``-1`` = empty; the
            indexer's picks), or ``None``.
        sink: Per-head sink logits ``[H]``, or ``None``: no sink (and no gradient for it).
        scale: Softmax scale.
        blocks: Blocks covering every query ``0 .. L-1`` exactly once
            (:meth:`hp_cp_core.columns.PlanColumns.dense_blocks`); blocks with a slot band
            (HCA) attend those slots densely, on top of ``idx``.
        picks: how a block whose picks lie in its slot band reads them (:data:`PICK_READS`;
            the same result each way).

    Returns:
        ``[B, L, H, D]`` in ``q``'s dtype.

    Raises:
        ValueError: ``picks`` is not one of :data:`PICK_READS`.
    """
    if picks not in PICK_READS:
        raise ValueError(
            f"picks={picks!r} is not a way to read picks; expected one of {PICK_READS}"
        )
    batch, seq, _, dim = q.shape
    if cmp_kv is None:
        cmp_kv = kv_ext.new_zeros(batch, 0, dim)
    if idx is None:
        idx = torch.full((1, seq, 0), -1, dtype=torch.long, device=q.device)
    return _BandedSparseAttention.apply(q, kv_ext, cmp_kv, idx, sink, scale, tuple(blocks), picks)
