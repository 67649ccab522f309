"""CPU stand-ins for the operations the real mindformers 2.1.0 cells call but MindSpore 2.10 has
no CPU kernel for (or gets wrong on CPU). Test infrastructure only: ``install()`` puts them in
place in a worker process that runs the REAL cells; the product never imports this module.

Every stand-in is checked by ``test_mf_cpu_standins.py`` against the operation it replaces on
inputs where both run, or against the documented formula (numpy) where the original has no CPU
kernel at all. What each one replaces, and why:

==========================  ====================================  ===========================
replaced                    CPU failure on MindSpore 2.10         stand-in
==========================  ====================================  ===========================
``mint.arange``             kernel ``Arange`` unregistered        host ``np.arange``
``mint.full``               kernel ``FillScalar`` unregistered    ``ops.full``
``mint.roll``               kernel ``Roll`` unregistered          two slices + ``cat``
``mint.topk``               kernel ``TopkExt`` unregistered       host stable argsort (ties
                                                                  to the lower index) +
                                                                  ``mint.gather`` (values keep
                                                                  their gradient)
``mint.stack``              kernel ``StackExt`` unregistered      ``ops.stack``
``mint.ones_like``          kernel ``OnesLikeExt`` unregistered   ``ops.ones_like``
``mint.index_select``       kernel ``IndexSelect`` unregistered   ``ops.gather``
``mint.tril``               kernel ``TrilExt`` unregistered       ``ops.tril``
``mint.outer``              kernel ``Outer`` unregistered         ``a[:, None] * b[None]``
``mint.split``              runs, but its backward ignores the    ``ops.narrow`` slices
                            storage offset of view gradients
``ops.rms_norm`` (also as   kernel ``RmsNorm`` unregistered       ``x * rsqrt(mean(x^2) +
``layer_norm.rms_norm``)                                          eps) * gamma`` in fp32
``Tensor.detach``           no such method on 2.10                ``ops.stop_gradient``
``comm.all_gather_into_``   kernel ``InnerCommAllGather``         ``ops.AllGather`` forward,
``tensor`` (functional      unregistered (and ``ReduceScatter``,  ``AllReduce`` + own slice
form, ``output_tensor=      its backward, has no CPU kernel)      backward (only on the world
None``)                                                           group: CPU ``AllGather``)
==========================  ====================================  ===========================

The operations of the whole model (MoE: ``mint.histc``, ``GroupedMatmul``, the token
permutation; MTP: ``Tensor.clone``; ...) have their stand-ins in the sibling
``mf_model_standins``, installed here too.

``all_gather_into_tensor`` needs msrun ranks; the real-cell msrun worker checks it against its
formula (rank-major concatenation forward, sum over ranks of the own slice backward).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mf_model_standins
import numpy as np
from mindspore import Tensor, mint, ops
from mindspore import dtype as mstype
from mindspore.common._grad_function import _Function


def arange(start: int = 0, end: int | None = None, step: int = 1, *, dtype: Any = None) -> Tensor:
    """``mint.arange``: ``np.arange(start, end, step)`` (int64 unless ``dtype``)."""
    if end is None:
        start, end = 0, start
    return Tensor(np.arange(start, end, step), dtype or mstype.int64)


def full(size: Any, fill_value: float, *, dtype: Any = None) -> Tensor:
    """``mint.full``: ``ops.full`` (float32 unless ``dtype``)."""
    size = (int(size),) if isinstance(size, int) else tuple(int(s) for s in size)
    return ops.full(size, fill_value, dtype=dtype or mstype.float32)


def roll(t: Tensor, shifts: int, dims: int = 0) -> Tensor:
    """``mint.roll`` along one dim: ``np.roll`` as the last ``shifts`` rows moved to the front."""
    n = int(t.shape[dims])
    s = int(shifts) % n if n else 0
    if not s:
        return t
    return mint.cat([ops.narrow(t, dims, n - s, s), ops.narrow(t, dims, 0, n - s)], dims)


def topk(
    x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> tuple[Tensor, Tensor]:
    """``mint.topk`` (largest, sorted, along the last dim): the indices of a stable descending
    host sort (ties to the lower index), the values gathered on device (differentiable)."""
    if not largest or dim not in (-1, len(x.shape) - 1):
        raise NotImplementedError("the topk stand-in covers largest=True along the last dim")
    idx = np.argsort(-x.asnumpy(), axis=-1, kind="stable")[..., :k].astype(np.int64)
    index = Tensor(idx)
    return mint.gather(x, -1, index), index


def stack(tensors: Any, dim: int = 0) -> Tensor:
    """``mint.stack``: ``ops.stack``."""
    return ops.stack(list(tensors), dim)


def ones_like(t: Tensor, *, dtype: Any = None) -> Tensor:
    """``mint.ones_like``: ``ops.ones_like``."""
    out = ops.ones_like(t)
    return out if dtype is None else ops.cast(out, dtype)


def index_select(t: Tensor, dim: int, index: Tensor) -> Tensor:
    """``mint.index_select``: ``ops.gather`` along ``dim``."""
    return ops.gather(t, index, int(dim))


def outer(a: Tensor, b: Tensor) -> Tensor:
    """``mint.outer``: ``a[:, None] * b[None, :]``."""
    return mint.unsqueeze(a, 1) * mint.unsqueeze(b, 0)


def tril(t: Tensor, diagonal: int = 0) -> Tensor:
    """``mint.tril``: ``ops.tril``."""
    return ops.tril(t, int(diagonal))


def split(t: Tensor, split_size_or_sections: Any, dim: int = 0) -> tuple[Tensor, ...]:
    """``mint.split`` as ``ops.narrow`` slices (their backward places the gradient correctly)."""
    n = int(t.shape[dim])
    sizes = split_size_or_sections
    if isinstance(sizes, int):
        sizes = [sizes] * (n // sizes) + ([n % sizes] if n % sizes else [])
    out, at = [], 0
    for s in sizes:
        out.append(ops.narrow(t, dim, at, int(s)))
        at += int(s)
    return tuple(out)


def rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``ops.rms_norm``: ``(x * rsqrt(mean(x^2, -1) + eps) * gamma, rsqrt(...))`` in fp32."""
    x32 = ops.cast(x, mstype.float32)
    rstd = ops.rsqrt(mint.mean(x32 * x32, dim=-1, keepdim=True) + epsilon)
    return ops.cast(x32 * rstd * gamma, x.dtype), rstd


def detach(self: Tensor) -> Tensor:
    """``Tensor.detach``: ``ops.stop_gradient``."""
    return ops.stop_gradient(self)


class _AllGatherIntoTensor(_Function):
    @staticmethod
    def forward(ctx: Any, group: str, t: Tensor) -> Tensor:
        from mindspore.communication import get_rank

        ctx.group, ctx.rows, ctx.rank = group, int(t.shape[0]), int(get_rank(group))
        return ops.AllGather(group=group)(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        total = ops.AllReduce(ops.ReduceOp.SUM, group=ctx.group)(grad)
        return None, total[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def all_gather_into_tensor(
    output_tensor: Any = None,
    input_tensor: Tensor = None,
    group: Any = None,
    async_op: bool = False,
) -> tuple[Tensor, None]:
    """``comm.all_gather_into_tensor`` in the functional form mindformers 2.1.0 calls
    (``output_tensor=None``): ``([size * n, ...] rank-major, None)``, differentiable."""
    from mindspore.communication import GlobalComm

    if output_tensor is not None or async_op:
        raise NotImplementedError("the stand-in covers output_tensor=None, async_op=False")
    return _AllGatherIntoTensor.apply(group or GlobalComm.WORLD_COMM_GROUP, input_tensor), None


MINT = {
    "arange": arange,
    "full": full,
    "roll": roll,
    "topk": topk,
    "stack": stack,
    "ones_like": ones_like,
    "index_select": index_select,
    "split": split,
    "tril": tril,
    "outer": outer,
}


def install() -> Callable[[], None]:
    """Put every stand-in in place (before the real cells are built: they keep references to
    ``mint.split`` / ``mint.topk`` / ``rms_norm``); returns the undo."""
    targets: list[tuple[Any, str, Any]] = [(mint, name, fn) for name, fn in MINT.items()]
    targets.append((Tensor, "detach", detach))
    layer_norm = importlib.import_module("mindformers.pynative.layers.layer_norm")
    targets.append((layer_norm, "rms_norm", rms_norm))
    targets.append((ops, "rms_norm", rms_norm))  # read at build time (hyper-connections)
    comm = importlib.import_module("mindspore.ops.communication")
    targets.append((comm, "all_gather_into_tensor", all_gather_into_tensor))
    undo_model = mf_model_standins.install()
    missing = object()
    saved = [(obj, name, getattr(obj, name, missing)) for obj, name, _ in targets]
    for obj, name, fn in targets:
        setattr(obj, name, fn)

    def undo() -> None:
        for obj, name, old in reversed(saved):
            if old is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        undo_model()

    return undo
