"""Multi-token prediction under CP: the MTP token shift across ranks.

Note [MTP under CP]
~~~~~~~~~~~~~~~~~~~
mindformers 2.1.0's MTP layer ``k`` predicts token ``i + k + 1`` at row ``i``: it embeds the
input ids shifted up by one row per layer (``MultiTokenPredictionLayer._get_embeddings``) and
``process_mtp_loss`` shifts the labels and the loss mask the same way, all through the module
function ``roll_tensor(t, shifts=-1, dims=-1)``. On a rank's rows that slice is wrong at every
chunk end (a zero where the next chunk's first token belongs), so the MTP loss would silently
lose those rows and train on wrong inputs there::

    one device   ids  5 6 7 8 9 4      rolled  6 7 8 9 4 0
    cp 2         r0   5 6 7 -> 6 7 0   (wrong: 8)       r1  8 9 4 -> 9 4 0

While a model with MTP layers runs under CP, its ``construct`` runs with that module's
``roll_tensor`` replaced by :class:`CPRowShift`: the global shift, from this rank's rows and
the chunk edges of every rank in one small all-gather (plan: Note [Shifting rows across
ranks] in :mod:`hp_cp_core.shift`). The replacement lasts exactly one call of the model's
``construct`` (restored in ``finally``) and only the model ``enable_cp`` was given is
affected; ``disable_cp`` removes the wrapper. The MTP layers' attention cells are CSA cells
like the decoder's and run under CP with them.

The MTP loss must be a per-token sum (``calculate_per_token_loss=True``): otherwise
``process_mtp_loss`` divides by the rank's own token count, which no shift can repair, so
``enable_cp`` refuses such a model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mindspore import Tensor, mint, nn, ops
from mindspore.common import dtype as mstype

from hp_cp_core.errors import HpCpError
from hp_cp_core.layout import SequenceLayout
from hp_cp_core.shift import shift_plan

__all__ = ["CPRowShift", "check_mtp_owner", "mtp_owners", "wrap_mtp_owner"]

_SHIFT = "roll_tensor"
_HALF = 1 << 16


class CPRowShift:
    """``roll_tensor(tensor, shifts, dims)`` over the whole sequence while CP is on (Note
    [MTP under CP]): ``tensor``'s ``dims`` axis holds this rank's rows of the sequence.

    Args:
        group: the CP group (its ``gather_forward`` carries the chunk edges).
        layout: the CP layout name.
    """

    def __init__(self, group: Any, layout: str) -> None:
        self.group = group
        self.layout = layout

    def __call__(self, tensor: Tensor, shifts: int = 1, dims: int = 0) -> Tensor:
        nd = len(tensor.shape)
        dim = int(dims) % nd
        n_local = int(tensor.shape[dim])
        size, rank = self.group.size, self.group.rank
        plan = shift_plan(SequenceLayout(self.layout, size, n_local * size), rank, shifts)
        perm = (dim, *[k for k in range(nd) if k != dim])
        moved = mint.permute(tensor, perm) if dim else tensor  # rows first
        zero = ops.zeros((1, *moved.shape[1:]), moved.dtype)
        parts = [moved]
        if plan.needs_exchange:
            edges = ops.gather(moved, Tensor(plan.send), 0)
            parts.append(ops.stop_gradient(self._gather(edges)))
        pool = mint.cat([*parts, zero], 0)
        out = ops.gather(pool, Tensor(plan.take), 0)
        inverse = tuple(int(i) for i in np.argsort(perm))
        return mint.permute(out, inverse) if dim else out

    def _gather(self, edges: Tensor) -> Tensor:
        """``[m, ...]`` from every rank, rank-major, in ``edges``' dtype. MindSpore CPU
        collectives take floats only, so integers (token ids, labels) travel as two exact
        float32 halves of 16 bits each (``x = hi * 2**16 + lo``), booleans as 0 / 1."""
        dtype = edges.dtype
        if dtype not in mstype.int_type + mstype.uint_type:
            out = self.group.gather_forward(ops.cast(edges, mstype.float32), "mtp_shift")
            return ops.cast(out, dtype)
        m, size = int(edges.shape[0]), self.group.size
        wide = ops.cast(edges, mstype.int64)
        hi = ops.floor_divide(wide, _HALF)
        packed = ops.cast(mint.cat([hi, wide - hi * _HALF], 0), mstype.float32)  # [2m, ...]
        out = self.group.gather_forward(packed, "mtp_shift")  # [size * 2m, ...]
        first = (np.arange(size)[:, None] * 2 * m + np.arange(m)[None, :]).reshape(-1)
        halves = [ops.cast(ops.gather(out, Tensor(i), 0), mstype.int64) for i in (first, first + m)]
        return ops.cast(halves[0] * _HALF + halves[1], dtype)


def _shift_module(owner: nn.Cell) -> Any:
    """The Python module whose ``roll_tensor`` the owner's MTP layers call."""
    for layer in getattr(owner.mtp, "layers", ()):
        for cls in type(layer).__mro__:
            module = sys.modules.get(cls.__module__)
            if callable(getattr(module, _SHIFT, None)):
                return module
    return None


def mtp_owners(root: Any) -> list[nn.Cell]:
    """The cells under ``root`` (itself included) that run MTP layers (``mtp_process`` and an
    ``mtp`` block whose layers shift tokens with a module ``roll_tensor``)."""
    cells = getattr(root, "cells_and_names", None)
    if cells is None:
        return []
    return [
        cell
        for _, cell in cells()
        if getattr(cell, "mtp_process", False)
        and isinstance(getattr(cell, "mtp", None), nn.Cell)
        and _shift_module(cell) is not None
    ]


def check_mtp_owner(owner: nn.Cell) -> None:
    """Refuse an MTP loss that is a per-rank mean (see Note [MTP under CP])."""
    config = getattr(owner, "config", None)
    if config is not None and not getattr(config, "calculate_per_token_loss", True):
        raise HpCpError(
            f"`{type(owner).__name__}` has MTP layers and calculate_per_token_loss=False: "
            "its MTP loss is then divided by each rank's own token count, which is not the "
            "one-device loss under CP. Set calculate_per_token_loss=True (and divide the "
            "summed loss by the global token count), or mtp_num_layers=0."
        )


def wrap_mtp_owner(owner: nn.Cell, shift: CPRowShift) -> Callable[[], None]:
    """Run ``owner.construct`` with its MTP module's ``roll_tensor`` replaced by ``shift``
    for the duration of each call; returns the undo."""
    from hp_cp_mindformers.adapter import install_construct

    module = _shift_module(owner)
    inner = owner.__dict__.get("construct") or type(owner).construct.__get__(owner)

    def construct(*args: Any, **kwargs: Any) -> Any:
        local = getattr(module, _SHIFT)
        setattr(module, _SHIFT, shift)
        try:
            return inner(*args, **kwargs)
        finally:
            setattr(module, _SHIFT, local)

    return install_construct(owner, construct)
