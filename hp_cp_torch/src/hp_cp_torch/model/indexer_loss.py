"""The CSA lightning indexer's KL loss (Megatron's formulation), shared by the single-device
reference layer and the CP path so both compute it with the same code.

See Note [Indexer loss under CP] in :mod:`hp_cp_core.indexer_loss` for how the per-row sums of
the ranks become the one global token-weighted mean.

Per query row ``t`` (docs/semantics.md section 7, sparse variant):

* teacher: for each main head ``h``, ``a[t,h,j] = scale * q[t,h] . ckv[j]`` over the picked
  (visible) slots, normalised with the window and sink mass in the denominator,
  ``p = exp(a - logaddexp(LSE_window+sink, logsumexp_j a))``; summed over heads and
  L1-normalised over ``j``. ``q`` and the KV are detached. Without a sink (``None``) the
  denominator has no sink term. Latent (MLA) attention (``kind="latent"``) reads only its
  picks, in the absorbed form: ``a[t,h,j] = scale * q_latent[t,h] . [c_j ; k_rot_j]`` with
  ``q_latent = [W_k^T q_pass ; q_rot]`` (:func:`latent_queries`; Note [DSA attention on the
  latents] in :mod:`hp_cp_torch.kernels.latent_attention`), no window.
* student: ``log_softmax_j`` of the indexer scores over the same picked slots.
* ``kl[t] = sum_j target (log target - log student)``; 0 for a row with no picked slot (or
  one that sees nothing at all).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_cp_core.columns import PlanColumns
from hp_cp_core.config import CPContext
from hp_cp_core.indexer_loss import indexer_loss_weight
from hp_cp_torch.attention import chunk_columns
from hp_cp_torch.kernels.smallop import gather_rows
from hp_cp_torch.kernels.softmax import sink_logits

__all__ = [
    "attach_indexer_loss",
    "indexer_kl_rows",
    "indexer_loss_share",
    "indexer_scores_at",
    "latent_queries",
    "student_mismatch",
]

STUDENT_CHECK_ROWS = 8
"""How many local queries :func:`student_mismatch` scores both ways."""


def indexer_scores_at(
    q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Indexer scores of the picked slots only (the student), differentiable: ``[B, S, k]``.

    ``score[t, i] = sum_h w[t, h] * ReLU(qI[t, h] . KI[slots[t, i]])`` in fp32; picks of
    ``-1`` read slot 0 (the caller masks them).

    Args:
        q_idx: indexer queries ``[B, S, nh, Di]``.
        weights: head weights ``[B, S, nh]``.
        keys: indexer keys ``[B, N, Di]`` (``N`` may be 0).
        slots: picked slot ids ``[B, S, k]``, ``-1`` = none.
    """
    batch = keys.shape[0]
    if keys.shape[1] == 0:  # keep the (empty) keys in the graph: their gather's backward runs
        keys = torch.cat([keys, keys.new_zeros(batch, 1, keys.shape[2])], dim=1)
    picked = gather_rows(keys, slots.clamp(min=0)).float()  # [B, S, k, Di]
    logits = torch.einsum("bshd,bskd->bshk", q_idx.float(), picked).relu()
    return torch.einsum("bshk,bsh->bsk", logits, weights.float())


def student_mismatch(
    index_scores: Any, keys: torch.Tensor, selected: torch.Tensor, student: torch.Tensor
) -> str | None:
    """How far the indexer loss's student (``indexer_loss_scores``) is from the scores the
    selection ranks by, at the same picks, for a few local queries; ``None`` when they agree.

    ``index_scores(lo, hi, keys)`` are the selection's scores ``[B, hi - lo, N]``, ``keys
    [B, N, D_I]`` all slots, ``selected [B, L, k]`` the picks (``-1``: none), ``student
    [B, L, k]``. Tolerance: 1e-4 of the largest score in fp32, 3e-2 in 16-bit dtypes.
    """
    rows = torch.nonzero((selected[0] >= 0).any(-1)).flatten()
    if rows.numel() == 0:
        return None
    lo = int(rows[0])
    hi = min(lo + STUDENT_CHECK_ROWS, selected.shape[1])
    with torch.no_grad():
        picks = selected[:, lo:hi]
        ref = index_scores(lo, hi, keys).float().gather(-1, picks.clamp(min=0))
        got, ok = student[:, lo:hi].detach().float(), picks >= 0
        err, size = (ref - got).abs()[ok].max(), ref.abs()[ok].max()
    low = torch.finfo(keys.dtype).bits <= 16 or torch.finfo(student.dtype).bits <= 16
    if float(err) <= (3e-2 if low else 1e-4) * float(size) + 1e-6:
        return None
    return (
        f"the indexer loss's student scores (indexer_loss_scores) differ from index_scores at the "
        f"same picks by {float(err):.3g} (largest score {float(size):.3g}; queries "
        f"{lo}..{hi - 1} of this rank): the loss trains another score than the selection "
        "ranks by. The default indexer_loss_scores is DeepSeek's sum_h w * relu(q . k) over "
        "state.index_queries = (q, w); override it with your model's own scores at the picks."
    )


def indexer_kl_rows(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    window_cols: torch.Tensor,
    slot_cols: torch.Tensor,
    student: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Per-row KL(teacher || student) ``[B, S]`` (fp32); only ``student`` carries gradient.

    Args:
        q: main queries ``[B, S, H, D]`` (detached here).
        kv_pool: the KV pool ``[B, P, D]`` the columns index (detached here).
        window_cols: window pool rows ``[B, S, W]``, ``-1`` = empty.
        slot_cols: pool rows of the picked compressed slots ``[B, S, k]``, ``-1`` = none.
        student: indexer scores of the same picks ``[B, S, k]``.
        sink: per-head sink logits ``[H]``, or ``None``: no sink.
        scale: the main softmax scale.
    """
    with torch.no_grad():
        q32, pool = q.detach().float(), kv_pool.detach().float()
        if pool.shape[1] == 0:
            pool = pool.new_zeros(pool.shape[0], 1, pool.shape[2])
        window_lse = _logsumexp_cols(q32, pool, window_cols, scale, sink)  # [B, S, H]
        cmp_logits = _logits(q32, pool, slot_cols, scale)  # [B, S, H, k]
        full_lse = torch.logaddexp(window_lse, torch.logsumexp(cmp_logits, dim=-1))
        # a row that sees nothing (no column, no sink) has lse -inf: its mass is 0, not NaN
        full_lse = torch.where(torch.isneginf(full_lse), float("inf"), full_lse)
        mass = torch.exp(cmp_logits - full_lse[..., None]).sum(dim=2)  # [B, S, k]
        total = mass.sum(dim=-1, keepdim=True)
        target = torch.where(total > 0, mass / total.clamp(min=1e-30), torch.zeros_like(mass))
    valid = slot_cols >= 0
    any_valid = valid.any(dim=-1, keepdim=True)
    # rows with no pick get finite zeros (log_softmax of all -inf would be NaN, also in backward)
    fill = torch.where(any_valid, float("-inf"), 0.0)
    scores = torch.where(valid, student.float(), fill)
    log_student = torch.where(valid, torch.log_softmax(scores, dim=-1), 0.0)
    return (torch.xlogy(target, target) - target * log_student).sum(dim=-1)


def indexer_loss_share(
    call: CPContext,
    q: torch.Tensor,
    ori_ext: torch.Tensor,
    cmp_kv: torch.Tensor,
    selected: torch.Tensor,
    student: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    loss_mask: torch.Tensor | None = None,
    latent: Any = None,
    kv_heads: int | None = None,
    mean: bool = True,
) -> torch.Tensor:
    """This rank's share of the global loss: its rows' KL sum over ``N`` (all ranks' rows),
    or the sum itself (``mean=False``).

    The columns are the attention's own (:class:`~hp_cp_core.columns.PlanColumns`), chunk
    by chunk, so the teacher's window + sink mass is exactly the attention's. For latent
    attention (``latent`` given) they are the picks alone, rows of the latents ``cmp_kv``,
    scored by :func:`latent_queries` (the absorbed form of the attention's weights); for
    grouped-query attention (``kv_heads`` given) the picks alone, each head against its
    group's key.

    Args:
        call: the forward's context (plan, ``loss_rows``, ``query_chunk``).
        q: local queries ``[B, L, H, D]``.
        ori_ext: window KV in the ext frame ``[B, E, D]``.
        cmp_kv: global compressed KV ``[B, N, D]``.
        selected: the indexer's picks ``[B, L, k]`` (global slot ids, ``-1`` = none).
        student: their indexer scores ``[B, L, k]``, with gradient.
        sink: per-head sink logits ``[H]``, or ``None``: no sink.
        scale: the main softmax scale.
        loss_mask: ``[B, L]``, nonzero where a row counts; ``None``: every row.
        latent: ``AttentionParams.latent`` (:class:`~hp_cp_torch.model.spec.Latent`) of a
            ``kind="latent"`` layer: ``q`` is ``[B, L, H, nope + rope]`` and ``cmp_kv`` the
            latents ``[B, N, rank + rope]``; ``None`` for shared-KV attention.
        kv_heads: ``G`` of a ``kind="grouped"`` layer: ``cmp_kv`` rows are ``[k_0 .. k_{G-1}
            ; v_0 .. v_{G-1}]`` and query head ``j`` is scored against key ``j // (H / G)``.
    """
    columns = PlanColumns(call.plan, ori_ext.shape[1])
    picks_only = latent is not None or kv_heads is not None
    if latent is not None:
        q, pool = latent_queries(q, latent), cmp_kv
    elif kv_heads is not None:  # the keys of the rows [k_0 .. k_{G-1} ; v_0 .. v_{G-1}]
        pool = cmp_kv[..., : kv_heads * q.shape[-1]]
    else:
        pool = torch.cat([ori_ext, cmp_kv], dim=1)
    kls = []
    for lo, hi in columns.chunks(call.config.query_chunk):
        if not picks_only:
            window, slots = chunk_columns(columns, lo, hi, selected, True, q.shape[0], q.device)
        else:  # latent and grouped attention read their picks (rows of cmp_kv), no window
            slots = selected[:, lo:hi].to(q.device)
            window = slots[..., :0]
        kls.append(
            indexer_kl_rows(q[:, lo:hi], pool, window, slots, student[:, lo:hi], sink, scale)
        )
    kl = torch.cat(kls, dim=1)
    if loss_mask is not None:
        kl = kl * (loss_mask.reshape(kl.shape) != 0).to(kl.dtype)
    return kl.sum() * indexer_loss_weight(call) if mean else kl.sum()


def latent_queries(q: torch.Tensor, latent: Any) -> torch.Tensor:
    """The absorbed MLA queries ``q_latent = [W_k^T q_pass ; q_rot]`` ``[B, L, H, rank +
    rope]`` (fp32, detached) of ``q`` ``[B, L, H, nope + rope]``, with ``W_k`` from
    ``latent.up_proj`` (``kv_b_proj.weight`` viewed ``[H, nope + value, rank]``): their dot
    product with a latent row ``[c_j ; k_rot_j]`` is ``q . k_j`` of the expanded keys."""
    with torch.no_grad():
        q32 = q.detach().float()
        heads = q32.shape[2]
        w_kv = latent.up_proj.detach().float().view(heads, latent.nope + latent.value, -1)
        q_pass, q_rot = torch.split(q32, [latent.nope, latent.rope], dim=-1)
        q_nope = torch.einsum("blhd,hdr->blhr", q_pass, w_kv[:, : latent.nope])
        return torch.cat([q_nope, q_rot], dim=-1)


def _logits(q: torch.Tensor, pool: torch.Tensor, cols: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, S, H, K]``; a pool ``G`` times the queries' width holds ``G`` keys per row, head
    ``j`` scored against key ``j // (H / G)``."""
    kv = gather_rows(pool, cols.long().clamp(min=0))  # [B, S, K, G * D]
    groups = pool.shape[-1] // q.shape[-1]
    if groups == 1:
        logits = torch.einsum("bshd,bskd->bshk", q, kv) * scale
    else:
        qg, kg = q.unflatten(2, (groups, -1)), kv.unflatten(-1, (groups, -1))
        logits = torch.einsum("bsghd,bskgd->bsghk", qg, kg).flatten(2, 3) * scale
    return logits.masked_fill((cols < 0)[:, :, None, :], float("-inf"))


def _logsumexp_cols(
    q: torch.Tensor,
    pool: torch.Tensor,
    cols: torch.Tensor,
    scale: float,
    sink: torch.Tensor | None,
) -> torch.Tensor:
    """``log(sum exp(logits) + exp(sink))`` over ``cols`` ``[B, S, H]``: ``-inf`` for a row
    without a column and without a sink."""
    logits = _logits(q, pool, cols, scale)
    sink_f = sink_logits(sink, q.shape[2], q).detach().view(1, 1, -1, 1)
    return torch.logsumexp(torch.cat([logits, sink_f.expand(*logits.shape[:-1], 1)], -1), -1)


class _AttachIndexerLoss(torch.autograd.Function):
    """Identity on ``output``; backward seeds ``loss`` with ``coeff`` (Megatron's
    ``DSAIndexerLossAutoScaler``), so the indexer gets ``coeff * d loss`` and nothing else
    changes."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, coeff: float):
        ctx.coeff = coeff
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.coeff, dtype=dtype, device=device), None


def attach_indexer_loss(output: torch.Tensor, loss: torch.Tensor, coeff: float) -> torch.Tensor:
    """``output`` unchanged, with ``coeff * loss`` added to whatever is back-propagated through
    it. With ``coeff = 0`` backward still runs through the loss (zero gradients), so every
    rank reaches the same collectives and every indexer parameter gets a gradient."""
    return _AttachIndexerLoss.apply(output, loss, float(coeff)) if loss.requires_grad else output
