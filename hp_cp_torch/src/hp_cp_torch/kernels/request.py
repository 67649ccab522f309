"""What a kernel is called with: one :class:`AttentionRequest` (the kernels' one calling
convention, :mod:`hp_cp_torch.kernels.registry`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hp_cp_core.columns import PlanColumns

if TYPE_CHECKING:
    from hp_cp_torch.kernels.picked import HeadLayout

__all__ = ["AttentionRequest", "chunk_columns"]


@dataclass(frozen=True)
class AttentionRequest:
    """One attention call of a rank's local queries (the kernels' one calling convention).

    Attributes:
        q: local queries ``[B, L, H, D]``.
        ori_ext: window KV rows of the ext frame ``[B, E, D]`` (keys and values are one).
        cmp_kv: the compressed slots ``[B, N, D]`` in global slot order, or ``None`` (r = 0).
        plan: this rank's :class:`hp_cp_core.plan.RankPlan`.
        selected: the indexer's picks ``[B, L, k]`` (global slot ids, ``-1`` = none) for
            CSA, ``None`` otherwise (HCA: every visible slot).
        sink: per-head sink logits ``[H]`` (inside the softmax's max and denominator), or
            ``None``: no sink (a row that sees nothing gives 0).
        scale: the softmax scale.
        query_chunk: queries per chunk for chunked kernels.
        tuning: kernel-specific knobs (the banded kernel reads ``"picks"``).
        head_layout: ``None``: one KV head whose rows are keys and values at once (``shared_kv``,
            the window and slots above). Otherwise how ``H`` query heads read keys apart from
            values out of each slot row (grouped-query or latent attention,
            :class:`hp_cp_torch.kernels.picked.HeadLayout`): the columns are then the picks
            only (no window), and ``sink`` may be ``None``.
        up_proj: latent attention's ``kv_b_proj.weight`` (folded into the queries and the
            output), else ``None``.
    """

    q: torch.Tensor
    ori_ext: torch.Tensor
    cmp_kv: torch.Tensor | None
    plan: Any
    selected: torch.Tensor | None
    sink: torch.Tensor | None
    scale: float
    query_chunk: int = 1024
    tuning: Mapping[str, Any] = field(default_factory=dict)
    head_layout: HeadLayout | None = None
    up_proj: torch.Tensor | None = None

    @property
    def columns(self) -> PlanColumns:
        """The core's columns of the plan (window, then slots) in this request's ext frame."""
        return PlanColumns(self.plan, self.ori_ext.shape[1])

    def pool(self) -> torch.Tensor:
        """The KV pool ``[B, E + N, D]``: the ext frame's rows, then the compressed slots."""
        return self.ori_ext if self.cmp_kv is None else torch.cat([self.ori_ext, self.cmp_kv], 1)

    def column_chunks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(lo, hi, idx)`` per chunk of ``query_chunk`` queries: ``idx [B, hi-lo, K]`` the
        pool rows query ``lo + i`` attends to (window, then slots; ``-1`` = empty)."""
        columns, batch, device = self.columns, self.q.shape[0], self.q.device
        has_cmp = self.cmp_kv is not None
        for lo, hi in columns.chunks(self.query_chunk):
            window, slots = chunk_columns(columns, lo, hi, self.selected, has_cmp, batch, device)
            yield lo, hi, window if slots is None else torch.cat([window, slots], dim=-1)


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
