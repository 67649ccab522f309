"""Attention of many query heads over the rows each query picked: DSA's latent (MLA) attention
and grouped-query attention with keys apart from values, one kernel with two strategies per
query block and a hand-written backward.

Note [Picked attention: dense band or gather, per block]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A DSA layer's columns are the indexer's picks: query ``i`` reads ``k`` rows of the gathered
buffer ``rows [B, N, C]`` (``selected [B, L, k]``, ``-1`` = none). Its ``G`` KV heads each
serve ``h = H / G`` query heads and read their keys and values out of the same row::

    row j:  [ k_0 k_1 .. k_{G-1} | v_0 v_1 .. v_{G-1} ]     grouped (values apart from keys)
    row j:  [ c_j (rank)  | k_rot_j ]   keys = the whole row, values = c_j   latent (G = 1)

so a rank receives each row once, at the model's width, and each query head computes over
its own group's ``d_k`` / ``d_v`` columns only. The latent kind folds ``kv_b_proj`` into the
queries and the output (Note [DSA attention on the latents] in
:mod:`hp_cp_torch.kernels.latent_attention`), inside this kernel, block by block.

The core plans query blocks (:meth:`hp_cp_core.columns.PlanColumns.dense_blocks`); for each,
one of two strategies, chosen from the block's shape:

    block's visible rows  s0 .......................... s1       (n = s1 - s0)
    dense band:   q [h, l, d] @ rows[s0:s1]^T -> [h, l, n], masked to the picks
    gather:       rows[picks] -> [l, k, C];   q_i [h, d] @ picked_i^T -> [h, l, k]

* **dense band** where ``n <= F(heads) * k``: one matrix product per block, at matmul speed;
  a column weighs ``log(count)`` of the query's picks of it (``-inf``: not picked), as the
  banded kernel's picks band does (Note [Band plus gather, one softmax] in
  :mod:`hp_cp_torch.kernels.banded`), so repeated picks add up exactly as the gather does.
* **gather** elsewhere: ``index_select`` of the picks and ``l`` small products; the backward
  scatters only the block's ``[l, k, C]`` gradient (``index_add_``), never a gradient of the
  whole buffer per block.

``F(heads)`` (:func:`band_factor`) is where the two cost the same, measured on this 2-core CPU
(``python -m hp_cp_torch.bench.picked``, nothing else running): one block of 64 queries at the
published latent width (C = 576, ``kv_b_proj`` folded in, fp32), forward + backward, seconds,
dense band / gather, at ``n = 1, 2, 4, 8`` times the top-k::

    heads  top-k   n = k          2k             4k             8k          F
      8     256   0.015/0.106   0.023/0.106   0.039/0.096   0.074/0.101     8
      8    1024   0.039/0.353   0.077/0.392   0.172/0.360   0.311/0.356
     16     256   0.026/0.104   0.040/0.099   0.070/0.106   0.137/0.085     4
     16    1024   0.071/0.366   0.127/0.365   0.261/0.360   0.544/0.370
     32     256   0.047/0.126   0.077/0.109   0.141/0.118   0.256/0.131     2
     32    1024   0.138/0.444   0.261/0.457   0.639/0.457   1.239/0.458
     64     256   0.128/0.175   0.182/0.181   0.321/0.206   0.702/0.174     2
     64    1024   0.279/0.622   0.622/0.602   1.288/0.614   2.513/0.560
    128     256   0.238/0.331   0.346/0.267   0.603/0.280   1.291/0.349     1
    128    1024   0.681/0.918   1.273/0.875   2.474/1.003   4.901/0.907

The gather costs about the same at any head count (its ``[64, k, C]`` copy, index work and
``64`` small products dominate), the band grows with ``heads * n``: so the fewer the heads,
the wider the band that still wins. With ``G`` KV heads the gather's copy and its small
products grow ``G`` times (each row holds every group's key and value, and each group's
heads are their own products) while the band's work stays ``heads * n``; measured the same
way for grouped heads of 128 (8 query heads, top-k 256, one block; dense / gather, s)::

    n / k      G = 1           G = 2           G = 8
      8     0.027/0.026     0.024/0.067     0.040/0.258
     16     0.044/0.014     0.049/0.041     0.118/0.304
     32     0.089/0.015     0.121/0.060     0.320/0.407

so the band is taken up to ``G * F(H / G)`` times the top-k (``F`` read at the query heads
per KV head). A pinned strategy (``"dense"`` / ``"gather"``) overrides
it.

Both strategies share the softmax (fp32, with an optional per-head sink in the max and the
denominator) and keep only ``lse = m + log(denom)`` per (head, row); the backward recomputes
each block's weights from it (flash attention's backward), so nothing saved grows with the
columns or the heads' widths. The logits and their gradient (``q k^T``, ``do v^T``) are fp32
products; the four others (``p v``, ``ds k``, ``ds^T q``, ``p^T do``) round their weights,
queries and output gradients to the inputs' dtype and multiply there, accumulating into fp32,
as flash attention and hp_cp's Triton kernel do. In bf16 that is 1.1-1.25x faster per block
on this CPU (bf16 products run 2-4x fp32's) and stays closer to float64 than the model's own
op order in bf16 (``tests/torch/test_picked.py``); fp32 and fp64 inputs compute exactly as
before. ``kv_b_proj``'s fold multiplies in the model's dtype, as the model's own
``kv_b_proj`` does, and sums its weight gradient over fold groups in fp32: no fp32 copy of
the weight (at V3.2's widths 64 MiB, held twice in backward before).

A row that sees nothing (every pick ``-1``: hp_cp's padding rows, an empty document) has
``denom = 0`` (no sink) and gives 0, forward and backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hp_cp_core import HpCpError
from hp_cp_core.columns import DenseBlock, PlanColumns
from hp_cp_torch.kernels.softmax import finite_max, rounded, row_lse, safe_denominator

__all__ = [
    "BLOCK_ELEMENTS",
    "FOLD_ELEMENTS",
    "STRATEGIES",
    "HeadLayout",
    "attend_blocks",
    "band_factor",
    "block_rows",
    "picked_attention",
]

STRATEGIES = ("auto", "dense", "gather")
"""``auto``: per block by :func:`band_factor`; ``dense`` / ``gather``: every block so."""

BLOCK_ELEMENTS = 1 << 24
"""Most elements one block's scores, picked rows and per-head query / output tensors hold
together (~64 MiB in fp32) at any top-k, width and head count."""

_BAND_FACTORS = ((8, 8), (16, 4), (64, 2))
"""``(most heads, F)``: :func:`band_factor`'s measured table (Note [Picked attention: dense
band or gather, per block]); more heads than the last entry: 1."""


def band_factor(heads: int) -> int:
    """``F``: a block of ``G`` KV heads, each read by ``heads`` query heads, reads its picks as
    a dense band when its visible rows are at most ``G * F * k`` (Note [Picked attention:
    dense band or gather, per block])."""
    for most, factor in _BAND_FACTORS:
        if heads <= most:
            return factor
    return 1


@dataclass(frozen=True)
class HeadLayout:
    """How the query heads read a row of the gathered buffer.

    Attributes:
        groups: KV heads ``G``; query head ``j`` reads group ``j // (H / G)``.
        key_width, value_width: ``d_k`` and ``d_v`` of one group.
        values_at: the column where group 0's values start: ``G * d_k`` when values are
            apart from keys (grouped), 0 when they are the first ``d_v`` columns of the key
            (latent: ``c_j`` of ``[c_j ; k_rot_j]``).
        latent: ``(nope, rope, value, rank)`` of MLA with ``kv_b_proj`` folded in (the
            queries are ``[q_pass ; q_rot]`` and the output ``W_v`` of the latent sum), or
            ``None``.
    """

    groups: int
    key_width: int
    value_width: int
    values_at: int
    latent: tuple[int, int, int, int] | None = None

    @classmethod
    def grouped(cls, kv_heads: int, key_width: int, value_width: int) -> HeadLayout:
        """Keys ``[k_0 .. k_{G-1}]`` then values ``[v_0 .. v_{G-1}]`` in each row."""
        return cls(int(kv_heads), int(key_width), int(value_width), int(kv_heads * key_width))

    @classmethod
    def mla(cls, nope: int, rope: int, value: int, rank: int) -> HeadLayout:
        """MLA's latent rows ``[c ; k_rot]`` (``rank + rope``), one KV head."""
        return cls(1, int(rank + rope), int(rank), 0, (int(nope), int(rope), int(value), int(rank)))

    @property
    def row_width(self) -> int:
        """Columns a row holds."""
        if self.values_at == 0:
            return self.key_width
        return self.groups * (self.key_width + self.value_width)

    @property
    def group_width(self) -> int:
        """Columns of one group's row in :meth:`by_group`: its key, then (grouped) its value."""
        return self.key_width if self.values_at == 0 else self.key_width + self.value_width

    @property
    def value_offset(self) -> int:
        """Where a group's value starts in its :meth:`by_group` row."""
        return 0 if self.values_at == 0 else self.key_width

    def by_group(self, rows: torch.Tensor) -> torch.Tensor:
        """``[B, N, C]`` -> ``[B, G, N, w]``: each group's key and value side by side, group
        by group (latent: a view; grouped: one copy, so a gather reads each group's picks as
        contiguous rows and its products need no copies)."""
        if self.values_at == 0:
            return rows.unsqueeze(1)
        g, dk, dv = self.groups, self.key_width, self.value_width
        keys = rows[..., : g * dk].unflatten(-1, (g, dk))
        values = rows[..., g * dk :].unflatten(-1, (g, dv))
        return torch.cat([keys, values], dim=-1).transpose(1, 2).contiguous()

    def rows_of(self, grouped: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`by_group`: ``[B, G, N, w]`` -> ``[B, N, C]``."""
        if self.values_at == 0:
            return grouped[:, 0]
        dk = self.key_width
        keys, values = grouped[..., :dk].transpose(1, 2), grouped[..., dk:].transpose(1, 2)
        return torch.cat([keys.flatten(2), values.flatten(2)], dim=-1)

    def split(self, grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values (views) of rows laid out by :meth:`by_group`."""
        at = self.value_offset
        return grouped[..., : self.key_width], grouped[..., at : at + self.value_width]


def block_rows(query_chunk: int, picks: int, layout: HeadLayout, heads: int, batch: int) -> int:
    """Query rows per block: at most ``query_chunk``, few enough that a block's scores (a band
    of up to ``F * k`` columns, or ``k``), its picked rows and its per-head queries and
    outputs stay under :data:`BLOCK_ELEMENTS` (at least one row)."""
    k = max(int(picks), 1)
    width = layout.key_width + layout.value_width
    if layout.latent is not None:
        width += layout.latent[0] + layout.latent[2]
    factor = band_factor(heads // layout.groups) * layout.groups
    per_row = batch * (2 * heads * factor * k + k * layout.row_width + heads * width)
    return max(1, min(int(query_chunk), BLOCK_ELEMENTS // max(per_row, 1)))


def picked_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    selected: torch.Tensor,
    plan: Any,
    layout: HeadLayout,
    scale: float,
    sink: torch.Tensor | None = None,
    up_proj: torch.Tensor | None = None,
    *,
    query_chunk: int = 1024,
    strategy: str = "auto",
) -> torch.Tensor:
    """Each local query's attention over the rows it picked (Note [Picked attention: dense
    band or gather, per block]), logits and softmax in fp32, with gradients to ``q``,
    ``rows``, ``sink`` and ``up_proj``.

    Args:
        q: ``[B, L, H, D]`` local queries (latent: ``D = nope + rope``, ``[q_pass ; q_rot]``).
        rows: ``[B, N, C]`` the gathered rows in global order (the plan's slots).
        selected: ``[B, L, k]`` picked rows (global ids), ``-1`` = none.
        plan: this rank's :class:`hp_cp_core.plan.RankPlan` (its blocks).
        layout: how the heads read a row (:class:`HeadLayout`).
        scale: the softmax scale.
        sink: per-head sink logits ``[H]``, or ``None`` (no sink).
        up_proj: latent only: ``kv_b_proj.weight`` ``[H * (nope + value), rank]``.
        query_chunk: most query rows per block.
        strategy: one of :data:`STRATEGIES`.

    Returns:
        ``[B, L, H, d_v]`` (latent: ``value``) in ``q``'s dtype.
    """
    if strategy not in STRATEGIES:
        raise HpCpError(f"picked attention: strategy={strategy!r}; expected one of {STRATEGIES}.")
    heads = q.shape[2]
    if heads % layout.groups or rows.shape[-1] != layout.row_width:
        raise HpCpError(
            f"picked attention: {heads} query heads over {layout.groups} KV heads, rows of "
            f"width {rows.shape[-1]}; expected heads divisible by the KV heads and rows of "
            f"width {layout.row_width} (keys, then values)."
        )
    if (layout.latent is None) != (up_proj is None):
        raise HpCpError("picked attention: up_proj is given exactly for the latent layout.")
    k = selected.shape[-1]
    rows_per_block = block_rows(query_chunk, k, layout, heads, q.shape[0])
    factor = band_factor(heads // layout.groups) * layout.groups
    band = {"auto": factor * k, "dense": 1 << 62, "gather": 0}[strategy]
    blocks = PlanColumns(plan, 0).dense_blocks(rows_per_block, picks_band_max=band)
    return attend_blocks(q, rows, selected, blocks, layout, scale, sink, up_proj)


def attend_blocks(
    q: torch.Tensor,
    rows: torch.Tensor,
    selected: torch.Tensor,
    blocks: Sequence[DenseBlock],
    layout: HeadLayout,
    scale: float,
    sink: torch.Tensor | None = None,
    up_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`picked_attention` over given blocks (each query once): a block with
    ``picks_in_band`` reads its slot band ``[slot_start, slot_stop)``, the others gather."""
    selected = selected.to(q.device)
    return _PickedAttention.apply(q, rows, sink, up_proj, selected, blocks, layout, float(scale))


# ------------------------------------------------------------------ per-block math (fp32)
def _up(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the compute dtype: fp32, or fp64 for fp64 inputs."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@dataclass
class _Block:
    """One block's inputs: ``q`` and ``keys`` in fp32 for the logits (``q`` ``[B, G, h, l,
    d_k]`` for a band, ``[B, G, l, h, d_k]`` gathered; keys ``[B, G, 1, n, d]`` for a band,
    ``[B, G, l, k, d]`` gathered), the keys and values in the inputs' dtype for the weighted
    sums (Note [Picked attention: dense band or gather, per block]), and the logits' bias."""

    q: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    keys_in: torch.Tensor
    values_in: torch.Tensor
    bias: torch.Tensor
    dense: bool
    ids: torch.Tensor | None = None  # gathered: [B * G * l * k] rows of the grouped buffer

    @classmethod
    def of(cls, q, keys, values, bias, dense, layout, ids=None) -> _Block:  # noqa: ANN001
        """Keys and values in fp32 beside the inputs' (latent values: a view of the keys)."""
        keys32 = _up(keys)
        values32 = keys32[..., : layout.value_width] if layout.values_at == 0 else _up(values)
        return cls(q, keys32, values32, keys, values, bias, dense, ids)


def _bias_dense(sel: torch.Tensor, s0: int, n: int) -> torch.Tensor:
    """``[B, l, n]`` ``log(count)`` of each query's picks of band row ``s0 + c``."""
    inside = (sel >= s0) & (sel < s0 + n)
    col = torch.where(inside, sel - s0, n)
    counts = torch.zeros((*sel.shape[:-1], n + 1), dtype=torch.float32, device=sel.device)
    counts.scatter_add_(-1, col, torch.ones_like(col, dtype=torch.float32))
    return counts[..., :n].log()


def _load_block(
    q: torch.Tensor, rows: torch.Tensor, sel: torch.Tensor, block: DenseBlock, layout: HeadLayout
) -> _Block:
    """The block's queries, keys, values and bias, from ``rows`` laid out by group
    (:meth:`HeadLayout.by_group`, ``[B, G, N, w]``, in the inputs' dtype)."""
    batch, length = q.shape[0], q.shape[1]
    g, n_rows = layout.groups, rows.shape[2]
    qb = _up(q).unflatten(2, (g, -1)).permute(0, 2, 3, 1, 4)  # [B, G, h, l, d]
    if block.picks_in_band:
        s0, s1 = block.slot_start, block.slot_stop
        keys, values = layout.split(rows[:, :, s0:s1][:, :, None])  # [B, G, 1, n, d]
        bias = _bias_dense(sel, s0, s1 - s0)[:, None, None]  # [B, 1, 1, l, n]
        return _Block.of(qb, keys, values, bias, True, layout)
    base = torch.arange(batch * g, device=sel.device).view(batch, g, 1, 1) * n_rows
    ids = (sel.clamp(min=0)[:, None] + base).reshape(-1)  # [B, G, l, k] flat
    picked = rows.reshape(-1, rows.shape[-1]).index_select(0, ids)
    keys, values = layout.split(picked.view(batch, g, length, sel.shape[-1], -1))
    bias = torch.zeros(sel.shape, dtype=torch.float32, device=sel.device)
    bias = bias.masked_fill(sel < 0, -math.inf)[:, None, :, None]  # [B, 1, l, 1, k]
    return _Block.of(qb.transpose(2, 3), keys, values, bias, False, layout, ids)


def _logits(b: _Block, scale: float) -> torch.Tensor:
    """Dense: ``[B, G, h, l, n]``; gathered: ``[B, G, l, h, k]``."""
    return _mm(b.q, b.keys.transpose(-1, -2)) * scale + b.bias


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``; a band's ``[B, G, h, l, x] @ [B, G, 1, x, y]`` as one product over the
    group's ``h * l`` rows (not ``h`` products of ``l``)."""
    if b.dim() == a.dim() == 5 and b.shape[2] == 1 and a.shape[2] > 1:
        return _bmm(a.flatten(2, 3), b[:, :, 0]).unflatten(2, a.shape[2:4])
    return _bmm(a, b)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over equal batch dimensions as one ``torch.bmm`` (``matmul`` copies a
    transposed bf16 operand of more than three dimensions first, at twice the product's
    time on this CPU)."""
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.view(*a.shape[:-1], b.shape[-1])


def _mm_heads(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A band's ``sum_h a[h]^T b[h]``: ``[B, G, h, l, x], [B, G, h, l, y] -> [B, G, x, y]``."""
    return _bmm(a.flatten(2, 3).transpose(-1, -2), b.flatten(2, 3))


def _sink_view(sink: torch.Tensor | None, b: _Block, groups: int) -> torch.Tensor | None:
    """The sink ``[H]`` shaped to broadcast against the block's rows (no last dim)."""
    if sink is None:
        return None
    s = _up(sink).view(groups, -1)  # [G, h]
    return s[:, :, None] if b.dense else s[:, None, :]  # [G, h, 1] or [G, 1, h]


def _softmax(s: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, lse)``: the weights with the sink in the max and denominator, and ``lse``, ``+inf``
    where the row sees nothing (then ``p = 0`` here and in backward: Note [Rows that see
    nothing] in :mod:`hp_cp_torch.kernels.softmax`)."""
    m = s.amax(-1)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = finite_max(m)
    p = torch.exp(s - m[..., None])
    denom = p.sum(-1)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    return p / safe_denominator(denom)[..., None], row_lse(m, denom)


def _weighted(p: torch.Tensor, b: _Block) -> torch.Tensor:
    """``p @ values`` in fp32: ``[B, G, h, l, d_v]`` (gathered: ``[B, G, l, h, d_v]``), the
    weights rounded to the values' dtype for the product."""
    return _up(_mm(rounded(p, b.values_in), b.values_in))


def _to_heads(o: torch.Tensor, dense: bool) -> torch.Tensor:
    """``[B, G, h, l, d]`` (or gathered ``[B, G, l, h, d]``) -> ``[B, l, H, d]``."""
    o = o.permute(0, 3, 1, 2, 4) if dense else o.permute(0, 2, 1, 3, 4)
    return o.flatten(2, 3)


def _from_heads(t: torch.Tensor, groups: int, dense: bool) -> torch.Tensor:
    """``[B, l, H, d]`` -> the block's head layout (the inverse of :func:`_to_heads`)."""
    t = _up(t).unflatten(2, (groups, -1))  # [B, l, G, h, d]
    return t.permute(0, 2, 3, 1, 4) if dense else t.permute(0, 2, 1, 3, 4)


# ------------------------------------------------------------------ the latent fold
def _latent_weights(up_proj: torch.Tensor, q: torch.Tensor, lat: tuple[int, ...]):  # noqa: ANN202
    """``W_k [H, nope, rank]`` and ``W_v [H, value, rank]`` of ``kv_b_proj``, views in the
    queries' dtype: the fold multiplies in the model's dtype, as its ``kv_b_proj`` does."""
    nope, _, value, rank = lat
    w = up_proj.to(q.dtype).view(q.shape[2], nope + value, rank)
    return w[:, :nope], w[:, nope:]


def _fold_queries(q: torch.Tensor, w_k: torch.Tensor, lat: tuple[int, ...]) -> torch.Tensor:
    """``[q_pass W_k ; q_rot]``: ``[B, l, H, rank + rope]`` in fp32."""
    nope = lat[0]
    return _up(torch.cat([torch.einsum("blhd,hdr->blhr", q[..., :nope], w_k), q[..., nope:]], -1))


FOLD_ELEMENTS = 1 << 21
"""Most elements of one fold group's per-head latent tensors (``[rows, H, rank + rope]``,
fp32: 8 MiB each): ``kv_b_proj`` is folded in for a group of consecutive blocks at once, so
its ``H`` per-head products have many rows even where the attention's blocks are a few rows
(many heads, a large top-k)."""


def _fold_groups(blocks: Sequence[DenseBlock], rows: int) -> list[list[DenseBlock]]:
    """Consecutive blocks in groups of about ``rows`` local queries (contiguous ranges)."""
    groups: list[list[DenseBlock]] = []
    for block in blocks:
        last = groups[-1] if groups else None
        if last and last[-1].hi == block.lo and block.hi - last[0].lo <= rows:
            last.append(block)
        else:
            groups.append([block])
    return groups


class _PickedAttention(torch.autograd.Function):
    """Forward block by block without a graph, keeping ``lse [B, L, H]``; backward recomputes
    each block and writes the gradients by hand. MLA's ``kv_b_proj`` is folded in per group of
    blocks (:data:`FOLD_ELEMENTS`)."""

    @staticmethod
    def forward(ctx: Any, q, rows, sink, up_proj, selected, blocks, layout, scale):  # noqa: ANN001
        heads, g, lat = q.shape[2], layout.groups, layout.latent
        w = None if lat is None else _latent_weights(up_proj, q, lat)
        out_width = layout.value_width if lat is None else lat[2]
        out = q.new_empty((*q.shape[:3], out_width))
        lse = torch.empty(q.shape[:3], dtype=_up(q).dtype, device=q.device)
        fold_rows = max(1, FOLD_ELEMENTS // max(1, q.shape[0] * heads * layout.key_width))
        with torch.no_grad():
            by_group = layout.by_group(rows)  # [B, G, N, w]
            for group in _fold_groups(blocks, fold_rows):
                g_lo, g_hi = group[0].lo, group[-1].hi
                qg = q[:, g_lo:g_hi] if w is None else _fold_queries(q[:, g_lo:g_hi], w[0], lat)
                o = qg.new_empty((*qg.shape[:3], layout.value_width), dtype=_up(qg).dtype)
                for block in group:
                    lo, hi = block.lo, block.hi
                    b = _load_block(
                        qg[:, lo - g_lo : hi - g_lo], by_group, selected[:, lo:hi], block, layout
                    )
                    p, lse_b = _softmax(_logits(b, scale), _sink_view(sink, b, g))
                    o[:, lo - g_lo : hi - g_lo] = _to_heads(_weighted(p, b), b.dense)
                    lse[:, lo:hi] = _to_heads(lse_b[..., None], b.dense)[..., 0]
                if w is not None:
                    o = torch.einsum("blhr,hvr->blhv", o.to(q.dtype), w[1])
                out[:, g_lo:g_hi] = o.to(out.dtype)
        ctx.save_for_backward(q, rows, sink, up_proj, selected, lse)
        ctx.blocks, ctx.layout, ctx.scale, ctx.fold_rows = blocks, layout, scale, fold_rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205, C901
        q, rows, sink, up_proj, selected, lse = ctx.saved_tensors
        layout, scale, lat = ctx.layout, ctx.scale, ctx.layout.latent
        heads, g = q.shape[2], layout.groups
        need_q, need_rows, need_sink, need_w = ctx.needs_input_grad[:4]
        w = None if lat is None else _latent_weights(up_proj, q, lat)
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device) if need_q else None
        by_group = layout.by_group(rows.detach())  # [B, G, N, w]
        d_group = torch.zeros(by_group.shape, dtype=_up(rows).dtype, device=rows.device)
        dsink = torch.zeros(heads, dtype=_up(q).dtype, device=q.device) if need_sink else None
        dw = dw_k = dw_v = None
        if w is not None and need_w:  # fp32 sums over the fold groups' products
            dw = torch.zeros(up_proj.shape, dtype=_up(up_proj).dtype, device=up_proj.device)
            dw_k, dw_v = dw.view(heads, -1, lat[3]).split([lat[0], lat[2]], 1)
        want_dq = dq is not None or dw_k is not None
        flat_rows = d_group.view(-1, d_group.shape[-1])
        for group in _fold_groups(ctx.blocks, ctx.fold_rows):
            g_lo, g_hi = group[0].lo, group[-1].hi
            qg = q[:, g_lo:g_hi] if w is None else _fold_queries(q[:, g_lo:g_hi], w[0], lat)
            go_g = grad[:, g_lo:g_hi].to(q.dtype)  # [B, rows, H, d_out]
            if w is not None:  # out = o W_v^T: the latent sum's gradient
                go_g = torch.einsum("blhv,hvr->blhr", go_g, w[1])
            go_g = _up(go_g)
            rows_g = (*go_g.shape[:3],)
            o_g = go_g.new_empty((*rows_g, layout.value_width)) if dw_v is not None else None
            dq_g = go_g.new_empty((*rows_g, layout.key_width)) if want_dq else None
            for block in group:
                lo, hi = block.lo, block.hi
                b = _load_block(
                    qg[:, lo - g_lo : hi - g_lo], by_group, selected[:, lo:hi], block, layout
                )
                lse_b = _from_heads(lse[:, lo:hi, :, None], g, b.dense)[..., 0]
                p = torch.exp(_logits(b, scale) - lse_b[..., None])
                o = _weighted(p, b)
                if o_g is not None:
                    o_g[:, lo - g_lo : hi - g_lo] = _to_heads(o, b.dense)
                do = _from_heads(go_g[:, lo - g_lo : hi - g_lo], g, b.dense)
                delta = (do * o).sum(-1)  # [.., rows]
                if dsink is not None:
                    ps = torch.exp(_sink_view(sink, b, g) - lse_b)
                    dsink -= _to_heads((ps * delta)[..., None], b.dense)[..., 0].sum((0, 1))
                ds = p * (_mm(do, b.values.transpose(-1, -2)) - delta[..., None])
                ds = ds * scale
                if dq_g is not None:  # [B, l, H, d_k]
                    dq_b = _mm(rounded(ds, b.keys_in), b.keys_in)
                    dq_g[:, lo - g_lo : hi - g_lo] = _to_heads(dq_b, b.dense)
                if need_rows:
                    _add_row_grads(d_group, flat_rows, b, block, layout, ds, p, do)
            if w is not None and dw_v is not None:
                dw_v += torch.einsum(
                    "blhv,blhr->hvr", grad[:, g_lo:g_hi].to(q.dtype), o_g.to(q.dtype)
                )
            if dq_g is None:
                continue
            dqg = dq_g
            if w is not None:  # q_latent = [q_pass W_k ; q_rot]
                nope, rank = lat[0], lat[3]
                dq_lat = dqg[..., :rank].to(q.dtype)
                if dw_k is not None:
                    dw_k += torch.einsum("blhd,blhr->hdr", q[:, g_lo:g_hi, :, :nope], dq_lat)
                dqg = torch.cat([torch.einsum("blhr,hdr->blhd", dq_lat, w[0]), dqg[..., rank:]], -1)
            if dq is not None:
                dq[:, g_lo:g_hi] = dqg.to(dq.dtype)
        return (
            dq,
            layout.rows_of(d_group).to(rows.dtype) if need_rows else None,
            None if dsink is None else dsink.to(sink.dtype),
            None if dw is None else dw.to(up_proj.dtype),
            None,
            None,
            None,
            None,
        )


def _add_row_grads(
    d_group: torch.Tensor,
    flat_rows: torch.Tensor,
    b: _Block,
    block: DenseBlock,
    layout: HeadLayout,
    ds: torch.Tensor,
    p: torch.Tensor,
    do: torch.Tensor,
) -> None:
    """Add the block's key and value gradients (summed over each group's heads) to
    ``d_group``: a slice for a band, the picked rows' ``index_add_`` for a gather."""
    like = b.keys_in
    ds, p, q, do = (rounded(t, like) for t in (ds, p, b.q, do))
    if b.dense:  # [B, G, h, l, n]
        dk, dv = _mm_heads(ds, q), _mm_heads(p, do)  # [B, G, n, d]
        keys, values = layout.split(d_group[:, :, block.slot_start : block.slot_stop])
        keys.add_(dk)
        values.add_(dv)
        return
    dk = _bmm(ds.transpose(-1, -2), q)  # [B, G, l, k, d_k]
    dv = _bmm(p.transpose(-1, -2), do)
    if layout.values_at == 0:  # latent: the values are the keys' first columns
        picked = dk.to(d_group.dtype)
        picked[..., : layout.value_width] += dv
    else:
        picked = torch.cat([dk, dv], -1).to(d_group.dtype)  # [B, G, l, k, w]
    flat_rows.index_add_(0, b.ids, picked.view(-1, picked.shape[-1]))
