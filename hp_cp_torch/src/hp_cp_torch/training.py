"""Training under CP, any model: the label shift, each rank's loss share, the gradient sum.

A causal-LM step under CP shifts the labels on the full sequence before sharding
(:func:`cp_shift_labels`; ``handle.batch`` does it), takes each rank's share of the global
mean loss (:func:`cp_causal_lm_loss`) and sums the gradients over the CP group
(:func:`cp_sum_gradients`, or DDP / FSDP over a mesh that includes the CP dimension).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SUM_BUCKET_ELEMENTS", "cp_causal_lm_loss", "cp_shift_labels", "cp_sum_gradients"]


def cp_shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF's causal-LM label shift, done on the FULL sequence before sharding.

    Position t is trained to predict token t+1; the last position gets ``ignore_index``.
    HF's ``ForCausalLMLoss`` shifts inside the loss, on whatever rows it is given: on a CP
    shard that drops the target of each shard's last row and, load-balanced, pairs rows of
    different chunks. Shift the full labels first, then ``handle.shard(shifted, 1)``.
    """
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def cp_causal_lm_loss(
    logits_local: torch.Tensor,
    labels_shifted_local: torch.Tensor,
    n_tokens_global: int | torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy: ``sum over local tokens / N``.

    Summed over the CP ranks it equals HF's loss on the full sequence (mean over the
    ``N = (cp_shift_labels(labels) != ignore_index).sum()`` targets). Backward on each rank
    and sum the gradients over the CP group (:func:`cp_sum_gradients`).

    Args:
        logits_local: ``[B, L, V]`` logits of this rank's rows.
        labels_shifted_local: ``[B, L]`` this rank's rows of :func:`cp_shift_labels`.
        n_tokens_global: number of non-ignored shifted labels of the whole batch.
        ignore_index: label value that does not count.
    """
    logits = logits_local.float().reshape(-1, logits_local.shape[-1])
    target = labels_shifted_local.reshape(-1).to(logits.device)
    total = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(n_tokens_global):
        n_tokens_global = n_tokens_global.to(total.device)
    return total / n_tokens_global


SUM_BUCKET_ELEMENTS = 1 << 25
"""Most gradient entries :func:`cp_sum_gradients` sums in one collective (128 MiB of fp32):
what it holds beyond the gradients stays under this, whatever the model's size."""


def cp_sum_gradients(parameters: Iterable[torch.Tensor], group: Any = None) -> None:
    """Sum ``.grad`` over the CP group in place, in fp32 (bf16 gradients are summed in fp32
    and rounded once).

    One collective for which parameters have a gradient, then one per
    :data:`SUM_BUCKET_ELEMENTS` gradient entries (two in all for a model of up to 2^25
    parameters). A parameter may have no gradient on some ranks (an expert no local token was
    routed to); it counts as zero there, and stays ``None`` only where no rank has a
    gradient. ``group`` is a torch ``ProcessGroup`` (``None``: the default group) or a 1-D
    ``DeviceMesh``.
    """
    import torch.distributed as dist

    if group is not None and hasattr(group, "get_group"):
        group = group.get_group()
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    device = params[0].device
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, group=group)
    has = present.tolist()
    bucket: list[int] = []
    size = 0
    for i, p in enumerate(params):
        bucket.append(i)
        size += p.numel()
        last = i + 1 == len(params)
        if last or size + params[i + 1].numel() > SUM_BUCKET_ELEMENTS:
            _sum_bucket([params[j] for j in bucket], [has[j] for j in bucket], size, group)
            bucket, size = [], 0


def _sum_bucket(params: list[torch.Tensor], has: list[int], size: int, group: Any) -> None:
    """One all-reduce of these parameters' gradients, as one fp32 buffer of ``size``."""
    import torch.distributed as dist

    flat = torch.zeros(size, dtype=torch.float32, device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            flat[offset : offset + n].copy_(p.grad.reshape(-1))
        offset += n
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, present in zip(params, has):
        n = p.numel()
        if present:
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        offset += n
