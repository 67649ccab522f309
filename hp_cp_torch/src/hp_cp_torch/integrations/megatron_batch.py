"""Megatron's batch and loss under hp_cp: ``packed_seq_params``, ``megatron_labels`` and
``megatron_loss`` for a ``GPTModel`` whose attention :mod:`hp_cp_torch.integrations.megatron`
runs (Note [Megatron's CP group under hp_cp])."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_packed", "megatron_labels", "megatron_loss", "packed_seq_params"]

# Note [Megatron's CP group under hp_cp]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two mappings were possible: Megatron at context_parallel_size 1 with hp_cp's group beside it,
# or Megatron's own CP group and size reused as hp_cp's group. hp_cp takes the second:
#
# * Megatron's data loading gives every rank of a CP group the same micro-batch only when it
#   knows they are CP ranks; at context_parallel_size 1 they would be data-parallel ranks and
#   read different batches.
# * DDP reduces gradients over data x context parallel ranks scaled by 1 / (dp x cp), and the
#   schedule scales the indexer loss by cp (``forward_step_calc_loss``, schedules.py:386-392).
#   hp_cp's indexer loss on each rank is its rows' KL sum over the rows of ALL ranks (a share
#   of the global mean, not a local mean), so cp x (1 / cp) applies exactly the one-process
#   gradient. At context_parallel_size 1 the same shares would be averaged over the CP ranks
#   as data-parallel ranks: the indexer gradient 1 / cp of the one-process one.
# * Megatron's own CP code in the attention (the all-gather of keys, values and indexer keys,
#   the zigzag RoPE slice, the per-rank indexer loss) lives in the layer hp_cp replaces; the
#   batch is sharded by handle.batch in place of get_batch_on_this_cp_rank.
#
# With calculate_per_token_loss the loss function returns this rank's token count and
# finalize_model_grads sums it over dp x cp; without it the schedule divides each rank's loss
# by the count the loss function returns, so megatron_loss returns sum x cp / (the batch's
# count) and a count of 1: the global mean after DDP's average, whatever each rank's count.


def packed_seq_params(batch: Any) -> Any:
    """Megatron's ``PackedSeqParams`` (``qkv_format="thd"``) of a packed ``handle.batch``: the
    global boundaries of the padded stream, or ``None`` for a padded (unpacked) batch."""
    cu = getattr(batch, "cu_seqlens", None)
    if cu is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.as_tensor(cu, dtype=torch.int32, device=batch.input_ids.device)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def megatron_labels(batch: Any, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, loss_mask)`` for Megatron's ``GPTModel(..., labels=labels)`` from a
    ``handle.batch``: its shifted labels with ``ignore_index`` (padding, document ends) set to
    0 and masked out, as Megatron's cross entropy takes only vocabulary ids."""
    labels = batch.labels
    mask = labels != ignore_index
    return torch.where(mask, labels, torch.zeros_like(labels)), mask.to(torch.float32)


def megatron_loss(
    losses: torch.Tensor, loss_mask: torch.Tensor, batch: Any, cp_size: int, per_token: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, num_tokens)``, the first two values a Megatron ``loss_func`` returns under
    hp_cp (Note [Megatron's CP group under hp_cp]), from ``GPTModel``'s per-token losses and
    :func:`megatron_labels`' mask. With ``calculate_per_token_loss``: this rank's loss sum and
    target count (Megatron sums the counts over data x context parallel ranks). Without it:
    the sum times ``cp_size`` over the batch's targets (``batch.n_tokens``, all ranks) and a
    count of 1, so that DDP's average over the CP ranks gives the global mean whatever each
    rank's own count (Megatron's per-rank mean is exact only for equal counts)."""
    mask = loss_mask.reshape(-1).to(torch.float32)
    total = torch.sum(losses.reshape(-1).float() * mask)
    if per_token:
        return total, mask.sum().to(torch.int)
    n_tokens = torch.as_tensor(batch.n_tokens, device=total.device).to(torch.float32)
    one = torch.ones((), dtype=torch.int, device=total.device)
    return total * (cp_size / n_tokens.clamp(min=1)), one


def check_packed(psp: Any, checks: Any) -> None:
    """Record in ``checks`` what hp_cp cannot take from a ``PackedSeqParams``: another format,
    per-document padding, a real-token mask, dynamic CP."""
    fix = (
        "pass packed_seq_params(batch) of handle.batch(tokens, cu_seqlens=cu): the global "
        "boundaries of the stream, padded at its end by hp_cp."
    )
    if psp.qkv_format != "thd":
        checks.fail(f"got packed_seq_params with qkv_format={psp.qkv_format!r}; {fix}")
    pairs = (
        ("cu_seqlens_kv", psp.cu_seqlens_kv),
        ("cu_seqlens_q_padded", psp.cu_seqlens_q_padded),
        ("cu_seqlens_kv_padded", psp.cu_seqlens_kv_padded),
    )
    for name, other in pairs:
        if other is not None and not torch.equal(
            torch.as_tensor(other).cpu().long(), torch.as_tensor(psp.cu_seqlens_q).cpu().long()
        ):
            checks.fail(f"packed_seq_params.{name} differs from cu_seqlens_q; {fix}")
    if getattr(psp, "real_token_mask_q", None) is not None:
        checks.fail(f"packed_seq_params carries real_token_mask_q; {fix}")
    if getattr(psp, "local_cp_size", None) is not None:
        checks.fail(f"packed_seq_params.local_cp_size is set (dynamic CP); {fix}")
