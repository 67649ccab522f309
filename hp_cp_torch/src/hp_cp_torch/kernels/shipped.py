"""The kernels hp_cp_torch ships, as registry objects (:mod:`hp_cp_torch.kernels.registry`).

Each is called as ``kernel(request)``; the column-list kernels (small-op, efficient, Triton)
share :class:`ColumnKernel`, which runs ``fn(q, kv_pool, idx, sink, scale)`` chunk by chunk.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.kernels.smallop import sparse_attention_smallop

__all__ = ["BANDED", "EFFICIENT", "MODEL_OPS", "SMALLOP", "TRITON", "ColumnKernel"]


class ColumnKernel:
    """A kernel from a column-list function ``fn(q [B, l, H, D], kv_pool [B, P, D],
    idx [B, l, K], sink [H] or None, scale) -> [B, l, H, D]`` (``idx``: pool rows, ``-1``
    empty; ``sink=None``: no sink),
    run on :meth:`AttentionRequest.column_chunks`.

    Args:
        fn: the function.
        problem: ``device -> str | None``, why ``fn`` cannot run there (default: it can).
        bands: pass ``bands=`` (the plan's :meth:`~hp_cp_core.columns.PlanColumns.column_bands`,
            the Triton kernel's readers of the window and HCA columns) to ``fn``.
    """

    precision = "fp32"
    """The shipped column-list kernels upcast their inputs and compute in fp32 (the Triton
    kernel multiplies bf16 / fp16 tiles exactly and accumulates in fp32)."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        problem: Callable[[Any], str | None] | None = None,
        *,
        bands: bool = False,
    ) -> None:
        self.fn, self._problem, self.bands = fn, problem, bands

    def problem(self, device: Any) -> str | None:
        return None if self._problem is None else self._problem(device)

    def __call__(self, request: AttentionRequest) -> torch.Tensor:
        r = request
        pool = r.pool()
        hca = r.selected is None and r.cmp_kv is not None
        outs = []
        for lo, hi, idx in r.column_chunks():
            kw = {}
            if self.bands:
                kw["bands"] = r.columns.column_bands(lo, hi, pool.shape[1], with_slots=hca)
            outs.append(self.fn(r.q[:, lo:hi], pool, idx, r.sink, r.scale, **kw))
        return torch.cat(outs, dim=1)


class BandedKernel:
    """The window (and HCA's visible slots) as dense masked bands, only the indexer's top-k
    gathered, recomputed in backward (:mod:`hp_cp_torch.kernels.banded`); the default."""

    precision = "fp32"

    def __call__(self, request: AttentionRequest) -> torch.Tensor:
        from hp_cp_torch.kernels.banded import (
            PICKS_BAND_FACTOR,
            block_rows_for,
            sparse_attention_banded,
        )

        r = request
        width = 0 if r.selected is None else r.selected.shape[-1]
        rows = block_rows_for(r.q.shape[0], width, r.q.shape[-1])
        # HCA (slots, no picks): every visible slot, as a dense band per block; CSA: the
        # picks as a masked band where the block's visible slots are few
        hca = r.selected is None and r.cmp_kv is not None
        blocks = r.columns.dense_blocks(
            rows, with_slots=hca, picks_band_max=PICKS_BAND_FACTOR * width
        )
        picks = r.tuning.get("picks", "weights")
        return sparse_attention_banded(
            r.q, r.ori_ext, r.cmp_kv, r.selected, r.sink, r.scale, blocks, picks=picks
        )


def _lazy(target: str) -> Callable[..., Any]:
    """``"module:name"``, imported at its first call (a kernel's module only when it runs)."""
    module, _, name = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


class ModelOpOrder(ColumnKernel):
    """``attention_kernel="model_ops"``: the model's own attention op order, where its adapter
    has one (:meth:`hp_cp_torch.model_adapter.ModelAdapter.model_attention`; transformers'
    eager order for HF's models, NeMo's for NeMo's); elsewhere the small-op kernel."""

    model_op_order = True
    precision = "model"
    """The model's dtype where the adapter has the model's op order; the small-op kernel
    (fp32) elsewhere."""


BANDED = BandedKernel()
SMALLOP = ColumnKernel(sparse_attention_smallop)
EFFICIENT = ColumnKernel(_lazy("hp_cp_torch.kernels.efficient:sparse_attention_efficient"))
TRITON = ColumnKernel(
    _lazy("hp_cp_torch.kernels.triton_attention:sparse_attention_triton"),
    _lazy("hp_cp_torch.kernels.triton_attention:triton_problem"),
    bands=True,
)
MODEL_OPS = ModelOpOrder(sparse_attention_smallop)
