"""CPU stand-ins for the operations of the real mindformers 2.1.0 DeepSeek V4 MODEL (beyond its
attention cells: the MoE layers and multi-token prediction) that MindSpore 2.10 has only Ascend
kernels for. Test infrastructure only, a sibling of
``mf_cpu_standins`` (whose ``install()`` installs these too); the product never imports it.

``test_mf_moe_standins.py`` checks each against its documented formula (numpy), values and
gradients. The model runs with ``moe_permute_fusion=True``: its unfused path indexes tensors
with tensors, which needs ``CumsumExt`` inside MindSpore's ``Tensor.__getitem__`` (no CPU
kernel either, and not reachable by a stand-in):

==============================  ==============================  ==================================
replaced                        CPU failure on MindSpore 2.10   stand-in
==============================  ==============================  ==================================
``mint.histc`` (the router's    kernel ``HistcExt``             host ``np.histogram`` over
tokens-per-expert count)        unregistered                    ``bins`` equal bins of [min, max]
``mint.cumsum`` (the experts'   kernel ``CumsumExt``            ``ops.cumsum``
cumulative group ends)          unregistered
``GroupedMatmul`` (as the       no CPU kernel                   one ``matmul`` per group of rows
experts module imports it;                                      (``group_list``: cumulative ends,
``split_item=3, group_type=0``)                                 ``group_type=0``: split along M)
``ops.moe_token_permute``       Ascend only                     stable host argsort of the
                                                                flattened expert ids; rows
                                                                gathered on device
``ops.moe_token_unpermute``     Ascend only                     gather by ``sorted_indices``, then
                                                                ``sum_k probs[n, k] * row``
``mint.nn.functional.softplus`` runs; its backward has no CPU   ``ops.softplus`` (same formula;
(the router's ``sqrtsoftplus``)  kernel                          its backward runs on CPU)
``mint.zeros_like`` (the loss's kernel ``ZerosLikeExt``          ``ops.zeros_like``
backward)                       unregistered
``mint.scatter_add`` (the       kernel ``ScatterAddExt``        ``ops.tensor_scatter_elements``
loss's backward)                unregistered                    (``reduction="add"``)
``Tensor.clone`` (MTP labels)   kernel ``Clone`` unregistered   ``ops.deepcopy``
==============================  ==============================  ==================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
from mindspore import Tensor, mint, ops
from mindspore import dtype as mstype


def histc(x: Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Tensor:  # noqa: A002
    """``mint.histc``: counts in ``bins`` equal-width bins of ``[min, max]`` (the last bin holds
    ``max``; values outside are ignored; ``min == max == 0``: the data's range), float32."""
    values = x.asnumpy().astype(np.float64).reshape(-1)
    lo, hi = float(min), float(max)
    if lo == 0 and hi == 0 and values.size:
        lo, hi = float(values.min()), float(values.max())
    counts, _ = np.histogram(values, bins=int(bins), range=(lo, hi))
    return Tensor(counts.astype(np.float32))


def cumsum(x: Tensor, dim: int, *, dtype: Any = None) -> Tensor:
    """``mint.cumsum``: ``ops.cumsum`` (same ``dtype`` rule)."""
    return ops.cumsum(x, int(dim), dtype=dtype)


class GroupedMatmul:
    """``mindspore.ops.auto_generate.GroupedMatmul`` for what the experts call:
    ``split_item=3, group_type=0`` (one ``x [M, K]`` split along M into groups, one weight
    ``[E, K, N]`` per group), ``group_list`` the cumulative group ends (int64)."""

    def __init__(self, split_item: int = 3, group_type: int = 0, **kwargs: Any) -> None:
        if split_item != 3 or group_type != 0 or kwargs:
            raise NotImplementedError(
                "the GroupedMatmul stand-in covers split_item=3, group_type=0 only"
            )

    def __call__(
        self,
        x: list,
        weight: list,
        bias: Any = None,
        scale: Any = None,
        offset: Any = None,
        antiquant_scale: Any = None,
        antiquant_offset: Any = None,
        group_list: Tensor = None,
    ) -> list[Tensor]:
        if any(t is not None for t in (bias, scale, offset, antiquant_scale, antiquant_offset)):
            raise NotImplementedError("the GroupedMatmul stand-in takes no bias / quantisation")
        (rows,), (w,) = x, weight
        ends = np.asarray(group_list.asnumpy()).astype(np.int64).reshape(-1)
        starts = np.concatenate([[0], ends[:-1]])
        parts = [
            mint.matmul(ops.narrow(rows, 0, int(a), int(b - a)), w[e])
            for e, (a, b) in enumerate(zip(starts, ends))
            if b > a
        ]
        tail = int(rows.shape[0]) - int(ends[-1])
        if tail:  # rows after the last group: zeros (the kernel leaves them unspecified)
            parts.append(ops.zeros((tail, int(w.shape[-1])), rows.dtype))
        return [parts[0] if len(parts) == 1 else mint.cat(parts, 0)]


def moe_token_permute(
    tokens: Tensor, indices: Tensor, num_out_tokens: Any = None, padded_mode: bool = False
) -> tuple[Tensor, Tensor]:
    """``ops.moe_token_permute``: the rows of ``tokens [N, D]`` grouped by expert
    (``indices [N, K]`` or ``[N]``; a stable sort of the flattened ids, so ties keep token
    order), ``[N * K, D]``; and ``sorted_indices [N * K]`` int32: where each flattened
    (token, k) entry went (the map ``moe_token_unpermute`` reads)."""
    if num_out_tokens is not None or padded_mode:
        raise NotImplementedError("the moe_token_permute stand-in drops no token (no padding)")
    flat = np.asarray(indices.asnumpy()).reshape(-1)
    topk = 1 if len(indices.shape) == 1 else int(indices.shape[1])
    order = np.argsort(flat, kind="stable")  # permuted row -> flattened entry
    where = np.empty_like(order)
    where[order] = np.arange(order.size)  # flattened entry -> permuted row
    permuted = ops.gather(tokens, Tensor((order // topk).astype(np.int64)), 0)
    return permuted, Tensor(where.astype(np.int32))


def moe_token_unpermute(
    permuted_tokens: Tensor,
    sorted_indices: Tensor,
    probs: Tensor = None,
    padded_mode: bool = False,
    restore_shape: Any = None,
) -> Tensor:
    """``ops.moe_token_unpermute``: ``row[i] = permuted_tokens[sorted_indices[i]]``; with
    ``probs [N, K]`` the rows of a token merge as ``sum_k probs[n, k] * row[n * K + k]``
    (``[N, D]``), else ``[N * K, D]``."""
    if padded_mode or restore_shape is not None:
        raise NotImplementedError("the moe_token_unpermute stand-in covers padded_mode=False")
    rows = ops.gather(permuted_tokens, ops.cast(sorted_indices, mstype.int64), 0)
    if probs is None:
        return rows
    n, k = int(probs.shape[0]), int(probs.shape[1])
    rows = mint.reshape(rows, (n, k, -1)) * mint.unsqueeze(ops.cast(probs, rows.dtype), -1)
    return mint.sum(rows, dim=1)


def softplus(x: Tensor, beta: float = 1, threshold: float = 20) -> Tensor:
    """``mint.nn.functional.softplus``: ``ops.softplus`` (``log(1 + exp(beta * x)) / beta``,
    ``x`` where ``beta * x > threshold``), whose backward has a CPU kernel."""
    return ops.softplus(x, beta, threshold)


def zeros_like(t: Tensor, *, dtype: Any = None) -> Tensor:
    """``mint.zeros_like``: ``ops.zeros_like`` (cast to ``dtype``)."""
    out = ops.zeros_like(t)
    return out if dtype is None else ops.cast(out, dtype)


def scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """``mint.scatter_add``: ``out[i][index[i][j]][k] += src[i][j][k]`` along ``dim`` (a copy
    of ``x``), as ``ops.tensor_scatter_elements(..., reduction="add")``."""
    return ops.tensor_scatter_elements(x, index, src, axis=int(dim), reduction="add")


def clone(self: Tensor) -> Tensor:
    """``Tensor.clone``: ``ops.deepcopy`` (a new tensor with the same values)."""
    return ops.deepcopy(self)


def install() -> Callable[[], None]:
    """Put the model stand-ins in place (before the model is built: the router and the experts
    keep ``mint.histc``, ``mint.cumsum``, ``softplus`` at construction); returns the undo."""
    experts = importlib.import_module("mindformers.pynative.transformers.moe.experts")
    targets: list[tuple[Any, str, Any]] = [
        (mint, "histc", histc),
        (mint, "cumsum", cumsum),
        (experts, "GroupedMatmul", GroupedMatmul),
        (ops, "moe_token_permute", moe_token_permute),
        (ops, "moe_token_unpermute", moe_token_unpermute),
        (mint.nn.functional, "softplus", softplus),
        (mint, "zeros_like", zeros_like),
        (mint, "scatter_add", scatter_add),
        (Tensor, "clone", clone),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    for obj, name, fn in targets:
        setattr(obj, name, fn)

    def undo() -> None:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)

    return undo
