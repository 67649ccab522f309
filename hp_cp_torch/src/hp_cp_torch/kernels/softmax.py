"""The softmax with an optional sink that every shipped column and banded kernel shares.

Note [Rows that see nothing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A row may have no column at all: a row of hp_cp's layout padding, an empty document. With a
finite sink its softmax is the sink alone (output 0, ``lse = sink``). Without one (``sink
None``, or a sink of ``-inf``) the max is ``-inf`` and the plain formula is
``exp(-inf - -inf) / 0``, NaN, which then reaches real rows through a zero weight of the next
layer (``0 * NaN``). So every kernel takes:

* the max as ``0`` where it is ``-inf`` (:func:`finite_max`: every exponent is then
  ``exp(-inf) = 0``);
* the denominator as ``1`` where it is ``0`` (:func:`safe_denominator`: the output is
  ``0 / 1 = 0``);
* ``lse = +inf`` where the denominator is ``0`` (:func:`row_lse`), so backward's recomputed
  ``p = exp(logit - lse)`` and the sink's ``exp(sink - lse)`` are 0: zero gradients.

A row with a column, or a finite sink, is unchanged bit for bit. The Triton programs do the
same in their online softmax (:mod:`hp_cp_torch.kernels.triton_kernels`).
"""

from __future__ import annotations

import torch

__all__ = [
    "finite_max",
    "rounded",
    "row_lse",
    "safe_denominator",
    "sink_gradient",
    "sink_logits",
]


def sink_logits(sink: torch.Tensor | None, heads: int, like: torch.Tensor) -> torch.Tensor:
    """The sink as fp32 logits ``[H]`` on ``like``'s device: ``sink.float()`` (with its
    autograd history), or ``-inf`` for every head when ``sink`` is ``None`` (no sink)."""
    if sink is None:
        return torch.full((heads,), float("-inf"), dtype=torch.float32, device=like.device)
    return sink.float()


def finite_max(m: torch.Tensor) -> torch.Tensor:
    """``m`` with ``-inf`` (a row that sees nothing and has no sink) replaced by 0."""
    return torch.where(torch.isneginf(m), 0.0, m)


def safe_denominator(denom: torch.Tensor) -> torch.Tensor:
    """``denom`` with 0 (a row that sees nothing and has no sink) replaced by 1."""
    return torch.where(denom > 0, denom, 1.0)


def row_lse(m: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """``m + log(denom)``, and ``+inf`` where ``denom`` is 0 (see Note [Rows that see
    nothing]); ``m`` the :func:`finite_max` the denominator was taken at."""
    return torch.where(denom > 0, m + torch.log(denom), float("inf"))


def sink_gradient(
    sink: torch.Tensor | None, lse: torch.Tensor, delta: torch.Tensor
) -> torch.Tensor:
    """``d sink = -sum_{b,s} exp(sink - lse) * delta`` ``[H]`` fp32 for one chunk of rows
    (``lse``, ``delta = dO . o``: ``[B, n, H]``); zeros without a sink."""
    if sink is None:
        return lse.new_zeros(lse.shape[-1])
    return -(torch.exp(sink.detach().float() - lse) * delta).sum(dim=(0, 1))


def rounded(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in ``like``'s dtype where that is narrower than fp32, else ``t``: a kernel's
    weights (and their gradient) for its products with the values, keys and queries, rounded
    to the inputs' dtype and multiplied there, as flash attention does (the logits and the
    softmax stay fp32)."""
    return t if like.dtype == t.dtype or like.itemsize >= 4 else t.to(like.dtype)
