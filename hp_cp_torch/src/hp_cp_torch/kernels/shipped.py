"""The kernels hp_cp_torch ships, as registry objects (:mod:`hp_cp_torch.kernels.registry`).

Each is called as ``kernel(request)``; the column-list kernels (small-op, efficient, Triton)
share :class:`ColumnKernel`, which runs ``fn(q, kv_pool, idx, sink, scale)`` chunk by chunk.
Every one runs every attention kind: a request whose heads read keys apart from values
(``request.head_layout``: grouped-query or latent attention) goes to the picked kernel
(:mod:`hp_cp_torch.kernels.picked`), by its per-block choice for ``banded``, its dense band
for ``dense_picks``, its gather for ``gathered_picks`` and the column-list kernels.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from hp_cp_core import HpCpError
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.kernels.smallop import sparse_attention_smallop

__all__ = [
    "BANDED",
    "DENSE_PICKS",
    "EFFICIENT",
    "GATHERED_PICKS",
    "MODEL_OPS",
    "SMALLOP",
    "TRITON",
    "ColumnKernel",
    "run_picked",
]


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
    kinds = ("shared_kv", "grouped", "latent")
    """The attention kinds it runs (a kernel without ``kinds`` runs ``shared_kv`` only)."""
    picks_strategy = "gather"
    """Grouped and latent requests: each query's picks gathered (the picked kernel)."""

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
        if r.head_layout is not None:
            return run_picked(r, self.picks_strategy)
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
    gathered, recomputed in backward (:mod:`hp_cp_torch.kernels.banded`); the default.

    Args:
        picks: where a block reads the indexer's picks as a dense masked band of slots:
            ``"auto"`` (where the band is at most a few times the top-k wide: the measured
            crossover), ``"dense"`` (every block that sees a slot) or ``"gather"`` (never).
    """

    precision = "fp32"
    kinds = ("shared_kv", "grouped", "latent")

    def __init__(self, picks: str = "auto") -> None:
        self.picks_strategy = picks

    def __call__(self, request: AttentionRequest) -> torch.Tensor:
        from hp_cp_torch.kernels.banded import (
            PICKS_BAND_FACTOR,
            block_rows_for,
            sparse_attention_banded,
        )

        r = request
        if r.head_layout is not None:
            return run_picked(r, self.picks_strategy)
        width = 0 if r.selected is None else r.selected.shape[-1]
        rows = block_rows_for(r.q.shape[0], width, r.q.shape[-1])
        # HCA (slots, no picks): every visible slot, as a dense band per block; CSA: the
        # picks as a masked band where the block's visible slots are few
        hca = r.selected is None and r.cmp_kv is not None
        band = {"auto": PICKS_BAND_FACTOR * width, "dense": 1 << 62, "gather": 0}
        blocks = r.columns.dense_blocks(
            rows, with_slots=hca, picks_band_max=band[self.picks_strategy] if width else 0
        )
        picks = r.tuning.get("picks", "weights")
        return sparse_attention_banded(
            r.q, r.ori_ext, r.cmp_kv, r.selected, r.sink, r.scale, blocks, picks=picks
        )


def run_picked(request: AttentionRequest, strategy: str) -> torch.Tensor:
    """A grouped or latent request (``request.head_layout``) by the picked kernel."""
    from hp_cp_torch.kernels.picked import picked_attention

    r = request
    if r.selected is None:
        raise HpCpError(
            "grouped-query and latent attention read each query's picks: the layer needs an "
            "indexer (layer_spec(has_indexer=True)) or a layer whose selection it reuses."
        )
    return picked_attention(
        r.q,
        r.cmp_kv,
        r.selected,
        r.plan,
        r.head_layout,
        r.scale,
        r.sink,
        r.up_proj,
        query_chunk=r.query_chunk,
        strategy=strategy,
    )


def _lazy(target: str) -> Callable[..., Any]:
    """``"module:name"``, imported at its first call (a kernel's module only when it runs)."""
    module, _, name = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


class ModelOpOrder(ColumnKernel):
    """``attention_kernel="model_ops"``: the model's own attention op order, where its adapter
    has one (:meth:`hp_cp_torch.model.spec.ModelAdapter.attention`; transformers'
    eager order for HF's models, NeMo's for NeMo's); elsewhere the small-op kernel."""

    model_op_order = True
    precision = "model"
    """The model's dtype where the adapter has the model's op order; the small-op kernel
    (fp32) elsewhere."""


BANDED = BandedKernel()
DENSE_PICKS = BandedKernel("dense")
GATHERED_PICKS = BandedKernel("gather")
SMALLOP = ColumnKernel(sparse_attention_smallop)
EFFICIENT = ColumnKernel(_lazy("hp_cp_torch.kernels.efficient:sparse_attention_efficient"))
TRITON = ColumnKernel(
    _lazy("hp_cp_torch.kernels.triton_attention:sparse_attention_triton"),
    _lazy("hp_cp_torch.kernels.triton_attention:triton_problem"),
    bands=True,
)
MODEL_OPS = ModelOpOrder(sparse_attention_smallop)
