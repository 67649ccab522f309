"""Attention kernels by name: one calling convention, a registry a third party can add to.

A kernel is any object called as ``kernel(request)`` with one :class:`AttentionRequest` (a
rank's local queries, the window KV of its ext frame, the gathered compressed slots, the
plan, the indexer's picks, the sink and the scale) that returns the attention output
``[B, L, H, D]`` in the queries' dtype, with gradients to ``q``, ``ori_ext``, ``cmp_kv`` and
``sink``. It may also have:

* ``problem(device) -> str | None``: why it cannot run on ``device`` (``None``: it can),
  checked on every rank before any collective, so one rank's missing GPU fails them all;
* ``model_op_order = True``: a model adapter that has its model's own attention op order
  (:meth:`hp_cp_torch.model.spec.ModelAdapter.attention`) runs that instead;
* ``precision``: what it computes the logits, the softmax with the sink and the weighted sum
  in, whatever its inputs' dtype: ``"fp32"`` (every shipped kernel) or ``"model"`` (the
  inputs' dtype, op by op as the model rounds); :func:`kernel_precision` reads it (Note
  [Attention precision] in :mod:`hp_cp_torch.kernels.precision`).

``CPConfig(attention_kernel=NAME)`` picks one by name. Names resolve, in order,
from :func:`register_kernel` (this process), the entry points of group
``hp_cp.torch_kernels`` (a third party's package: ``name = "package.module:KERNEL"``, the
object or a class built without arguments), then the shipped kernels (:data:`SHIPPED`). An
unknown name is an :class:`~hp_cp_core.HpCpError` listing every registered kernel, raised
when ``enable_cp`` installs the layers (before any collective). A kernel that computes on
column lists ``fn(q, kv_pool, idx, sink, scale)`` (``idx [B, l, K]`` rows of the pool, ``-1``
empty) is registered as ``ColumnKernel(fn)`` (:mod:`hp_cp_torch.kernels.shipped`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import sys
from typing import Any

from hp_cp_core import HpCpError
from hp_cp_torch.kernels.request import AttentionRequest

__all__ = [
    "ENTRY_POINT_GROUP",
    "SHIPPED",
    "AttentionRequest",
    "kernel_named",
    "kernel_names",
    "kernel_precision",
    "register_kernel",
    "unregister_kernel",
    "uses_model_op_order",
]

ENTRY_POINT_GROUP = "hp_cp.torch_kernels"

SHIPPED: dict[str, str] = {
    "banded": "hp_cp_torch.kernels.shipped:BANDED",
    "dense_picks": "hp_cp_torch.kernels.shipped:DENSE_PICKS",
    "gathered_picks": "hp_cp_torch.kernels.shipped:GATHERED_PICKS",
    "smallop": "hp_cp_torch.kernels.shipped:SMALLOP",
    "efficient": "hp_cp_torch.kernels.shipped:EFFICIENT",
    "triton": "hp_cp_torch.kernels.shipped:TRITON",
    "model_ops": "hp_cp_torch.kernels.shipped:MODEL_OPS",
    "megatron": "hp_cp_torch.kernels.megatron:MEGATRON",
}
"""The kernels hp_cp_torch ships (imported by name on first use): ``banded`` (the default;
``dense_picks`` / ``gathered_picks``: the same with the indexer's picks always read as a
dense masked band, or always gathered, instead of its measured per-block choice),
``smallop`` (gathers the columns; the exact reference), ``efficient`` (memory flat in the
number of columns), ``triton`` (fused GPU kernels) and ``model_ops`` (the model's own op
order where its adapter has one, else ``smallop``)."""

_REGISTERED: dict[str, Any] = {}
"""Kernels registered in this process by :func:`register_kernel` (the one mutable registry:
like pluggy's plugin manager, it holds what the program registered; entry points are read on
first use, once per ``sys.path``, and the shipped kernels imported by name)."""


def register_kernel(name: str, kernel: Any) -> None:
    """Register ``kernel`` (see the module docstring) as ``attention_kernel=name`` in this
    process; it shadows an entry point or shipped kernel of that name.

    Raises:
        HpCpError: ``name`` is not a non-empty string or ``kernel`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise HpCpError(f"register_kernel: the name must be a non-empty string, got {name!r}.")
    if not callable(kernel):
        raise HpCpError(
            f"register_kernel({name!r}, ...): the kernel must be callable as "
            f"kernel(request: AttentionRequest), got a `{type(kernel).__name__}`."
        )
    _REGISTERED[name] = kernel


def unregister_kernel(name: str) -> None:
    """Remove a kernel :func:`register_kernel` registered (nothing if there is none)."""
    _REGISTERED.pop(name, None)


def _entry_points() -> dict[str, Any]:
    """The ``hp_cp.torch_kernels`` entry points by name, read once per ``sys.path`` (a name is
    looked up on every forward; ``_entry_points_for.cache_clear()`` re-reads them)."""
    return _entry_points_for(md.entry_points, tuple(sys.path))


@functools.lru_cache(maxsize=4)
def _entry_points_for(source: Any, path: tuple[str, ...]) -> dict[str, Any]:
    del path  # part of the cache key
    return {ep.name: ep for ep in source(group=ENTRY_POINT_GROUP)}


def kernel_names() -> list[str]:
    """Every kernel name ``attention_kernel`` may take, sorted."""
    return sorted({*SHIPPED, *_entry_points(), *_REGISTERED})


def kernel_named(name: Any) -> Any:
    """The kernel registered as ``name`` (a kernel object is returned as is).

    Raises:
        HpCpError: no kernel has that name (the message lists the registered ones), or its
            entry point fails to load.
    """
    if not isinstance(name, str):
        if callable(name):
            return name
        raise HpCpError(f"attention_kernel must be a kernel name (a string), got {name!r}.")
    if name in _REGISTERED:
        return _REGISTERED[name]
    eps = _entry_points()
    if name in eps:
        try:
            found = eps[name].load()
        except Exception as exc:  # noqa: BLE001 - named in the error
            raise HpCpError(
                f"attention kernel {name!r}: its entry point {eps[name].value!r} (group "
                f"{ENTRY_POINT_GROUP}) failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        return found() if isinstance(found, type) else found
    if name in SHIPPED:
        module, _, attr = SHIPPED[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    raise HpCpError(
        f"CPConfig.attention_kernel={name!r} is not a registered torch kernel; "
        f"registered: {kernel_names()}. Register one with "
        "hp_cp_torch.kernels.registry.register_kernel(name, kernel) or an entry point in "
        f"group {ENTRY_POINT_GROUP!r}."
    )


def uses_model_op_order(name: Any) -> bool:
    """Whether kernel ``name`` asks for the model's own attention op order."""
    return bool(getattr(kernel_named(name), "model_op_order", False))


def kernel_precision(name: Any) -> str | None:
    """What kernel ``name`` computes the attention in (its ``precision``: ``"fp32"`` or
    ``"model"``), or ``None`` where the kernel does not say."""
    return getattr(kernel_named(name), "precision", None)
