"""MindSpore tensor ops and autograd-aware collectives on ``mindspore.communication``.

Which collective implements an exchange is chosen by :class:`Capabilities`, detected from the
device target and the group:

================  =========================================  =================================
exchange          CPU (mccl; tested here)                    Ascend / GPU (not tested here)
================  =========================================  =================================
halo rows         forward: one ``AllGather`` of every rank's  forward: the same ``AllGather``;
(window KV + x    send rows (both tensors, all destinations)  backward: ``ReduceScatter``
in one message)   padded to a common size; backward: one
                  ``AllReduce``, keep the own slot
compressed slots  ``AllGather`` (world group) or, on a        ``AllGather``; backward:
(main + indexer   sub-group, ``AllReduce`` of a zero buffer   ``ReduceScatter``
in one message)   holding the own rows; backward:
                  ``AllReduce``, keep the own rows
================  =========================================  =================================

MindSpore 2.10 on CPU has neither send/recv nor ReduceScatter, and AllGather only on the world
group (the AllReduce emulation of an all-gather is exact: ``x + 0 == x``). Only the CPU path is
exercised by this repository's tests. A point-to-point halo exchange for Ascend
(``mint.distributed`` P2P) would plug in where :meth:`MindSporeGroup.exchange_rows` picks
``_ExchangeRowsGather``; until it exists every device uses the all-gather form.

Every exchange is one ``_Function`` that takes the layer's order token and returns the next
(Note [Backward order] in :mod:`hp_cp_core.collectives`; a token is a one-element tensor, since
0-element tensors do not survive MindSpore's CPU backward), so every rank runs every backward
collective in reverse forward order, also a rank that received nothing or never used what it
received.
Index arrays are built on the host with numpy; empty slices are taken as ``t[n:n]`` (never
``t[0:0]``, whose CPU backward fails) so empty results stay in the autograd graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, ops
from mindspore.common._grad_function import _Function
from mindspore.communication import GlobalComm, get_group_size, get_rank

from hp_cp_core import HpCpError
from hp_cp_core.runners import InstallingBackend

__all__ = [
    "Capabilities",
    "MindSporeBackend",
    "MindSporeGroup",
    "detect_capabilities",
    "resolve_mesh",
]


# --------------------------------------------------------------------------------------------
# mesh -> (group name, rank, size)


@dataclass(frozen=True)
class MeshInfo:
    """The CP group a mesh stands for: communication group name, this rank, size."""

    group: str | None
    rank: int
    size: int


_MESH_FIX = (
    "Pass a HyperParallel-style 1-D mesh (an object with size(), get_local_rank() and "
    "get_group(), e.g. mesh['cp']) or a mindspore.communication group name such as "
    "GlobalComm.WORLD_COMM_GROUP (after mindspore.communication.init())."
)


def _comm_ready(group: str) -> tuple[int, int]:
    if not getattr(GlobalComm, "INITED", True):  # before init() every group says "rank 0 of 1"
        raise HpCpError(
            f"cannot use communication group {group!r}: mindspore.communication is not "
            "initialised. Call mindspore.communication.init() on every rank (started with "
            "msrun) and create the group with create_group before enable_cp."
        )
    try:
        return int(get_rank(group)), int(get_group_size(group))
    except Exception as exc:  # noqa: BLE001 - MindSpore raises RuntimeError / ValueError
        raise HpCpError(
            f"cannot use communication group {group!r}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}. Call "
            "mindspore.communication.init() on every rank (started with msrun) and create the "
            "group with create_group before enable_cp."
        ) from exc


def resolve_mesh(mesh: Any) -> MeshInfo:
    """The CP group of a HyperParallel-style mesh or a group name; ``HpCpError`` otherwise."""
    if isinstance(mesh, str):
        rank, size = _comm_ready(mesh)
        return MeshInfo(mesh, rank, size)
    needed = ("size", "get_local_rank", "get_group")
    if mesh is not None and all(callable(getattr(mesh, n, None)) for n in needed):
        ndim = getattr(mesh, "ndim", 1)
        if isinstance(ndim, int) and ndim != 1:
            names = getattr(mesh, "mesh_dim_names", None)
            raise HpCpError(
                f"enable_cp needs a 1-D mesh for the CP dimension, got a {ndim}-D mesh with dims "
                f"{names}. Pass the CP dim, e.g. mesh['cp']."
            )
        size = int(mesh.size())
        rank = int(mesh.get_local_rank())
        if size <= 1:
            return MeshInfo(None, 0, 1)
        group = mesh.get_group()
        name = group if isinstance(group, str) else getattr(group, "group_name", None)
        if not isinstance(name, str):
            raise HpCpError(
                f"mesh.get_group() returned a {type(group).__name__}; expected a "
                f"mindspore.communication group name (str). {_MESH_FIX}"
            )
        got_rank, got_size = _comm_ready(name)
        if (got_rank, got_size) != (rank, size):
            raise HpCpError(
                f"the mesh says rank {rank} of {size} but its group {name!r} says rank "
                f"{got_rank} of {got_size}; expected them to agree. {_MESH_FIX}"
            )
        return MeshInfo(name, rank, size)
    raise HpCpError(f"enable_cp(mesh=...) got a {type(mesh).__name__}; {_MESH_FIX}")


# --------------------------------------------------------------------------------------------
# capabilities


@dataclass(frozen=True)
class Capabilities:
    """Which collectives the device offers on this group.

    Attributes:
        device: ``ms.get_context("device_target")``.
        all_gather: ``AllGather`` works on this group (on CPU only on the world group).
        reduce_scatter: ``ReduceScatter`` exists (not on CPU).
        p2p: point-to-point send / receive exists (not on CPU). Not used yet.
    """

    device: str
    all_gather: bool
    reduce_scatter: bool
    p2p: bool


def detect_capabilities(group: str | None) -> Capabilities:
    """Capabilities of ``group`` on the current device target."""
    device = str(ms.get_context("device_target"))
    cpu = device.upper() == "CPU"
    world = group is None or group == GlobalComm.WORLD_COMM_GROUP
    return Capabilities(device, all_gather=(not cpu) or world, reduce_scatter=not cpu, p2p=not cpu)


# --------------------------------------------------------------------------------------------
# small tensor helpers (empty-safe)


def _rows(t: Tensor) -> int:
    return int(t.shape[0])


def _empty_like_rows(t: Tensor) -> Tensor:
    """A 0-row view of ``t`` that stays in the autograd graph (``t[n:n]``; ``t[0:0]``'s CPU
    backward fails, so a 0-row ``t`` is returned as is)."""
    n = _rows(t)
    return t[n:n] if n > 0 else t


def _zeros(shape: Sequence[int], dtype: Any) -> Tensor:
    return ops.zeros(tuple(int(s) for s in shape), dtype)


def _features(t: Tensor) -> int:
    return int(np.prod(t.shape[1:], dtype=np.int64))


def _gather_rows(t: Tensor, index: np.ndarray) -> Tensor:
    index = np.asarray(index, dtype=np.int64).reshape(-1)
    if index.size == 0:
        return _empty_like_rows(t)
    return ops.gather(t, Tensor(index), 0)


def _cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    tensors = list(tensors)
    return tensors[0] if len(tensors) == 1 else mint.cat(tensors, dim)


_ITEMSIZE = {ms.float32: 4, ms.float16: 2, ms.bfloat16: 2, ms.float64: 8, ms.int32: 4}


def _itemsize(dtype: Any) -> int:
    return _ITEMSIZE.get(dtype, 4)


# --------------------------------------------------------------------------------------------
# the group


@dataclass(frozen=True, eq=False)
class _ExchangeLayout:
    """Where every (item, destination) block sits in every rank's flat send buffer.

    ``counts[s, i, d]``: rows rank s sends of item i to rank d; ``offsets[s, i, d]``: element
    offset of that block in rank s's buffer; ``padded``: buffer elements per rank.
    """

    counts: np.ndarray
    offsets: np.ndarray
    totals: np.ndarray
    padded: int
    widths: tuple[int, ...]


class MindSporeGroup:
    """A CP group on ``mindspore.communication`` implementing the core's ``Group`` protocol."""

    # exchange_rows is an AllGather of every rank's send rows on every device (see the module
    # docstring): compressed slots take the core's all-gather path, which moves less through it
    point_to_point = False

    def __init__(self, info: MeshInfo, caps: Capabilities | None = None) -> None:
        self.name = info.group
        self.rank = info.rank
        self.size = info.size
        self.caps = caps if caps is not None else detect_capabilities(info.group)
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.calls: dict[str, int] = {}
        self.by_kind: dict[str, dict[str, int]] = {}
        self._prims: dict[str, Any] = {}
        self._layouts: dict[tuple, tuple[tuple[Any, ...], _ExchangeLayout]] = {}

    # -- bookkeeping ------------------------------------------------------------------------
    def count(self, kind: str, sent: int, recv: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_recv += int(recv)
        self.calls[kind] = self.calls.get(kind, 0) + 1
        k = self.by_kind.setdefault(kind, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
        k["calls"] += 1
        k["bytes_sent"] += int(sent)
        k["bytes_recv"] += int(recv)

    def stats(self) -> dict[str, Any]:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_recv": self.bytes_recv,
            "collectives": dict(self.calls),
            "by_kind": {k: dict(v) for k, v in self.by_kind.items()},
            "device": self.caps.device,
        }

    # -- primitives -------------------------------------------------------------------------
    def _prim(self, kind: str) -> Any:
        prim = self._prims.get(kind)
        if prim is None:
            group = self.name or GlobalComm.WORLD_COMM_GROUP
            if kind == "ag":
                prim = ops.AllGather(group=group)
            elif kind == "ar":
                prim = ops.AllReduce(ops.ReduceOp.SUM, group=group)
            else:
                prim = ops.ReduceScatter(ops.ReduceOp.SUM, group=group)
            self._prims[kind] = prim
        return prim

    def _all_reduce(self, t: Tensor, kind: str) -> Tensor:
        n = int(np.prod(t.shape, dtype=np.int64)) * _itemsize(t.dtype)
        ring = 2 * (self.size - 1) * n // self.size
        self.count(kind, ring, ring)
        return self._prim("ar")(t)

    def gather_forward(self, t: Tensor, kind: str) -> Tensor:
        """``[n, ...]`` from every rank -> ``[size * n, ...]`` (rank-major), no autograd."""
        n = int(np.prod(t.shape, dtype=np.int64)) * _itemsize(t.dtype)
        if self.caps.all_gather:
            self.count(kind, n if self.size > 1 else 0, n * (self.size - 1))
            return self._prim("ag")(t)
        rows, rest = _rows(t), tuple(t.shape[1:])
        parts = []
        if self.rank:
            parts.append(_zeros((self.rank * rows, *rest), t.dtype))
        parts.append(t)
        if self.size - 1 - self.rank:
            parts.append(_zeros(((self.size - 1 - self.rank) * rows, *rest), t.dtype))
        return self._all_reduce(_cat(parts), kind)

    def gather_backward(self, g: Tensor, rows: int, kind: str) -> Tensor:
        """Sum of every rank's gradient of the gathered buffer, this rank's ``rows`` rows."""
        if self.caps.reduce_scatter:
            n = int(np.prod(g.shape, dtype=np.int64)) * _itemsize(g.dtype)
            self.count(kind, n * (self.size - 1) // self.size, n * (self.size - 1) // self.size)
            return self._prim("rs")(g)
        total = self._all_reduce(g, kind)
        return total[self.rank * rows : (self.rank + 1) * rows]

    # -- Group protocol ---------------------------------------------------------------------
    def begin_order(self, anchor: Tensor) -> Tensor:
        return _OrderBegin.apply(anchor) if anchor is not None else _new_token()

    def end_order(self, output: Any, token: Tensor | None) -> Any:
        if token is None:
            return output
        if isinstance(output, Tensor):
            return _OrderEnd.apply(output, token)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
            return type(output)([_OrderEnd.apply(output[0], token), *output[1:]])
        raise HpCpError(
            f"the CP attention hook returned a {type(output).__name__}; expected the layer "
            "output tensor (or a tuple starting with it) so the backward order token can be "
            "attached to it."
        )

    def exchange_rows(
        self, items: Sequence[tuple[Tensor, Any]], token: Tensor | None
    ) -> tuple[list[Tensor], Tensor | None]:
        tensors = [t for t, _ in items]
        if self.size == 1:  # no collective, so nothing to order
            return tensors, token
        plans = [p for _, p in items]
        layout = self._exchange_layout(tensors, plans)
        if layout.padded == 0:  # nobody sends anything (symmetric: padded is global)
            return tensors, token
        token, *outs = _ExchangeRowsGather.apply(self, layout, plans, _token(token), *tensors)
        return outs, token

    def all_gather_rows(self, tensor: Tensor, token: Tensor | None) -> tuple[Tensor, Any]:
        if self.size == 1:
            return tensor, token
        if _rows(tensor) == 0:  # no slot anywhere (cap is the same on every rank)
            return _zeros((0, *tensor.shape[1:]), tensor.dtype), token
        token, out = _AllGatherRows.apply(self, _token(token), tensor)
        return out, token

    def all_gather_dim(self, tensor: Tensor, dim: int) -> Tensor:
        if self.size == 1:
            return tensor
        nd = len(tensor.shape)
        dim = dim % nd
        perm = (dim, *[k for k in range(nd) if k != dim])
        moved = mint.permute(tensor, perm)
        shape = tuple(moved.shape)
        flat = mint.reshape(moved, (shape[0], _features(moved)))
        gathered, _ = self.all_gather_rows(flat, None)
        out = mint.reshape(gathered, (self.size * shape[0], *shape[1:]))
        inverse = tuple(int(i) for i in np.argsort(perm))
        return mint.permute(out, inverse)

    def all_gather_meta(self, values: np.ndarray) -> np.ndarray:
        local = np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))
        if self.size == 1:
            return local[None]
        if self.caps.all_gather:
            # CPU AllGather truncates int64 to 32 bits: move the exact bits as int32 pairs
            out = self.gather_forward(Tensor(local.view(np.int32).copy()), "meta").asnumpy()
            return out.astype(np.int32).view(np.int64).reshape(self.size, local.size)
        # AllReduce form (CPU reduces floats only): 16-bit chunks in float32 are summed exactly
        bits = local.view(np.uint64)
        chunks = np.stack([(bits >> np.uint64(16 * k)) & np.uint64(0xFFFF) for k in range(4)], 1)
        out = self.gather_forward(Tensor(chunks.astype(np.float32)), "meta").asnumpy()
        out = out.astype(np.uint64).reshape(self.size, local.size, 4)
        shifts = (np.arange(4, dtype=np.uint64) * np.uint64(16))[None, None, :]
        return np.bitwise_or.reduce(out << shifts, axis=2).view(np.int64)

    # -- exchange layout (one tiny meta all-gather per new plan, then cached) ---------------
    def _exchange_layout(self, tensors: Sequence[Tensor], plans: Sequence[Any]) -> _ExchangeLayout:
        widths = tuple(_features(t) for t in tensors)
        key = (tuple(id(p) for p in plans), widths)
        hit = self._layouts.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], plans)):
            return hit[1]
        n_items, size = len(plans), self.size
        mine = np.array([[p.send_rows[d].size for d in range(size)] for p in plans], np.int64)
        meta = self.all_gather_meta(np.concatenate([np.array(widths, np.int64), mine.ravel()]))
        if np.any(meta[:, :n_items] != meta[0, :n_items]):
            raise HpCpError(
                f"CP ranks exchange halo rows of different widths {meta[:, :n_items].tolist()}; "
                "expected every rank to pass tensors of the same batch and feature sizes."
            )
        counts = meta[:, n_items:].reshape(size, n_items, size)
        for i, p in enumerate(plans):
            if not np.array_equal(counts[:, i, self.rank], np.asarray(p.recv_counts)):
                raise HpCpError(
                    f"CP rank {self.rank} expects {list(p.recv_counts)} halo rows from the "
                    f"ranks but they send {counts[:, i, self.rank].tolist()}; expected the same "
                    "plan on every rank (same global lengths, cu_seqlens and layout)."
                )
        elems = counts * np.array(widths, np.int64)[None, :, None]
        flat = elems.reshape(size, -1)
        offsets = (np.cumsum(flat, axis=1) - flat).reshape(size, n_items, size)
        totals = flat.sum(axis=1)
        layout = _ExchangeLayout(counts, offsets, totals, int(totals.max()), widths)
        if len(self._layouts) >= 64:  # same eviction order on every rank (same call sequence)
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = (tuple(plans), layout)
        return layout


def _new_token() -> Tensor:
    return _zeros((1,), ms.float32)


def _token(token: Tensor | None) -> Tensor:
    return token if token is not None else _new_token()


class _OrderBegin(_Function):
    """The first token of a layer, from its input; backward: a zero gradient for the input
    that exists only after the layer's first exchange ran its backward."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor) -> Tensor:
        ctx.anchor = (tuple(anchor.shape), anchor.dtype)
        return _new_token()

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        return _zeros(*ctx.anchor)


class _OrderEnd(_Function):
    """Identity on the layer output; backward hands the last token its gradient, which starts
    the layer's backward exchanges, last to first."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, token: Tensor) -> Tensor:
        return output * 1

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        return grad, _new_token()


class _ExchangeRowsGather(_Function):
    """``[received rows (source-rank order) ; own]`` per item via one padded AllGather.

    Forward: every rank packs the rows it sends (all items, all destinations) into one flat
    buffer padded to the common size; one AllGather; each rank cuts out its blocks.
    Backward: each rank writes the gradient of its received rows into the senders' slots of a
    global buffer; one ReduceScatter (CPU: AllReduce, then the own slot); each rank adds the
    gradients of the rows it sent.
    """

    @staticmethod
    def forward(
        ctx: Any,
        group: MindSporeGroup,
        layout: _ExchangeLayout,
        plans: list,
        token: Tensor,
        *tensors: Tensor,
    ):
        ctx.group, ctx.layout, ctx.plans = group, layout, plans
        ctx.shapes = [tuple(t.shape) for t in tensors]
        dtype = tensors[0].dtype if all(t.dtype == tensors[0].dtype for t in tensors) else None
        wire = dtype if dtype is not None else ms.float32
        ctx.wire = wire
        me, size = group.rank, group.size
        parts = []
        for t, p in zip(tensors, plans):
            for d in range(size):
                rows = p.send_rows[d]
                if rows.size:
                    block = mint.reshape(_gather_rows(t, rows), (-1,))
                    parts.append(block if block.dtype == wire else ops.cast(block, wire))
        pad = layout.padded - int(layout.totals[me])
        if pad:
            parts.append(_zeros((pad,), wire))
        gathered = group.gather_forward(_cat(parts), "halo_exchange")
        outs = []
        for i, (t, p) in enumerate(zip(tensors, plans)):
            got = []
            for s in range(size):
                n = int(p.recv_counts[s])
                if n:
                    start = s * layout.padded + int(layout.offsets[s, i, me])
                    block = gathered[start : start + n * layout.widths[i]]
                    block = mint.reshape(block, (n, *t.shape[1:]))
                    got.append(block if block.dtype == t.dtype else ops.cast(block, t.dtype))
            outs.append(_cat([*got, t]) if got else t * 1)
        return (_new_token(), *outs)

    @staticmethod
    def backward(ctx: Any, _token_grad: Tensor, *grads):
        group, layout, plans = ctx.group, ctx.layout, ctx.plans
        me, size, wire = group.rank, group.size, ctx.wire
        grads = [
            g if g is not None else _zeros((p.n_halo + s[0], *s[1:]), wire)
            for g, p, s in zip(grads, plans, ctx.shapes)
        ]
        # place the gradient of every received block at its sender's slot
        pieces, pos = [], 0
        starts = [0] * len(plans)
        for s in range(size):
            for i, (g, p) in enumerate(zip(grads, plans)):
                n = int(p.recv_counts[s])
                if not n:
                    continue
                at = s * layout.padded + int(layout.offsets[s, i, me])
                if at > pos:
                    pieces.append(_zeros((at - pos,), wire))
                block = mint.reshape(g[starts[i] : starts[i] + n], (-1,))
                pieces.append(block if block.dtype == wire else ops.cast(block, wire))
                starts[i] += n
                pos = at + n * layout.widths[i]
        end = size * layout.padded
        if end > pos:
            pieces.append(_zeros((end - pos,), wire))
        # sum over ranks, keep this rank's slot (ReduceScatter, or AllReduce + slice on CPU)
        mine = group.gather_backward(_cat(pieces), layout.padded, "halo_exchange_bwd")
        out = []
        for i, (g, p, shape) in enumerate(zip(grads, plans, ctx.shapes)):
            local = g[p.n_halo :] if p.n_halo else g
            width = layout.widths[i]
            idx, vals = [], []
            for d in range(size):
                rows = p.send_rows[d]
                if rows.size:
                    start = int(layout.offsets[me, i, d])
                    vals.append(
                        mint.reshape(mine[start : start + rows.size * width], (rows.size, width))
                    )
                    idx.append(rows)
            if vals:
                flat = mint.reshape(local, (shape[0], width))
                add = _cat(vals)
                if add.dtype != flat.dtype:
                    add = ops.cast(add, flat.dtype)
                index = Tensor(np.concatenate(idx).astype(np.int32))
                local = mint.reshape(mint.index_add(flat, 0, index, add), shape)
            out.append(local)
        return (None, None, None, _new_token(), *out)


class _AllGatherRows(_Function):
    """``[cap, F]`` from every rank -> ``[size * cap, F]``; backward: sum over ranks, own rows."""

    @staticmethod
    def forward(ctx: Any, group: MindSporeGroup, token: Tensor, tensor: Tensor):
        ctx.group, ctx.rows = group, _rows(tensor)
        return _new_token(), group.gather_forward(tensor, "all_gather")

    @staticmethod
    def backward(ctx: Any, _token_grad: Tensor, grad: Tensor):
        return None, _new_token(), ctx.group.gather_backward(grad, ctx.rows, "all_gather_bwd")


# --------------------------------------------------------------------------------------------
# the backend


class MindSporeBackend(InstallingBackend):
    """The mindformers backend: tensor ops for the core helpers, groups and forward install.

    On a whole model, installing a CSA layer also puts its parent attention's RoPE at the
    rank's global positions (Note [The parent's RoPE under CP] in
    :mod:`hp_cp_mindformers.rope`); installing the first layer also puts the model's MTP
    token shift (Note [MTP under CP] in :mod:`hp_cp_mindformers.mtp`) and its MoE routers'
    aux-loss statistics (Note [MoE aux loss under CP] in :mod:`hp_cp_mindformers.moe`) under
    CP. Each install's undo restores what it changed.
    """

    name = "mindformers"

    def __init__(self, find: Any, install: Any) -> None:
        super().__init__(find, install)
        self._parents: dict[int, Any] = {}
        self._model: tuple[int, list[Any], list[Any]] = (0, [], [])

    def find_layers(self, module: Any) -> list[Any]:
        from hp_cp_mindformers.moe import moe_routers
        from hp_cp_mindformers.mtp import mtp_owners
        from hp_cp_mindformers.rope import rotary_parents

        layers = super().find_layers(module)
        self._parents = rotary_parents(module, layers)
        first = id(layers[0]) if layers else 0
        self._model = (first, mtp_owners(module), moe_routers(module))
        return layers

    def install(self, layer: Any, cp_forward: Any, group: Any) -> Any:
        from hp_cp_mindformers.moe import put_routers_under_cp
        from hp_cp_mindformers.mtp import CPRowShift, check_mtp_owner, wrap_mtp_owner
        from hp_cp_mindformers.rope import wrap_parent_rotary

        config = cp_forward.config
        local = group.size == 1 and config.single_rank_bypass
        first, owners, routers = self._model
        if id(layer) != first or group.size == 1:  # the model-wide parts: once, cp > 1
            owners, routers = [], []
        for owner in owners:  # before the first install: a refusal leaves nothing behind
            check_mtp_owner(owner)
        undos = [super().install(layer, cp_forward, group)]
        parent = self._parents.get(id(layer))
        if parent is not None and not local:
            undos.append(wrap_parent_rotary(parent, config.layout, group.rank, group.size))
        undos += [wrap_mtp_owner(o, CPRowShift(group, config.layout)) for o in owners]
        if routers:
            undos.append(put_routers_under_cp(routers, group.name, group.size))
        if len(undos) == 1:
            return undos[0]

        def undo() -> None:
            for fn in reversed(undos):
                fn()

        return undo

    def group(self, mesh: Any) -> MindSporeGroup:
        return MindSporeGroup(resolve_mesh(mesh))

    # ops (dim 0 = rows); index arrays arrive as numpy int64
    def cat(self, tensors: Sequence[Tensor]) -> Tensor:
        return _cat(tensors, 0)

    def narrow(self, t: Tensor, start: int, length: int) -> Tensor:
        if length == 0:
            return _empty_like_rows(t)
        return t[int(start) : int(start) + int(length)]

    def index_rows(self, t: Tensor, index: np.ndarray) -> Tensor:
        return _gather_rows(t, index)

    def num_rows(self, t: Tensor) -> int:
        return _rows(t)

    def flatten_rows(self, t: Tensor) -> Tensor:
        return mint.reshape(t, (_rows(t), _features(t)))

    def unflatten_rows(self, t: Tensor, like_shape: tuple[int, ...]) -> Tensor:
        return mint.reshape(t, tuple(int(s) for s in like_shape))

    def cat_features(self, tensors: Sequence[Tensor]) -> Tensor:
        return _cat(tensors, 1)

    def split_features(self, t: Tensor, sizes: Sequence[int]) -> list[Tensor]:
        # slicing, not mint.split: its CPU backward ignores the offset of view gradients
        if len(sizes) == 1:
            return [t]
        bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        return [t[:, int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:])]

    def pad_rows(self, t: Tensor, rows: int) -> Tensor:
        extra = int(rows) - _rows(t)
        if extra <= 0:
            return t
        return mint.cat([t, _zeros((extra, *t.shape[1:]), t.dtype)], 0)

    def shape(self, t: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in t.shape)

    def take(self, t: Any, index: np.ndarray, dim: int) -> Any:
        if isinstance(t, np.ndarray):
            return np.take(t, np.asarray(index), axis=dim)
        return ops.gather(t, Tensor(np.asarray(index, dtype=np.int64)), int(dim))

    def as_tensor(self, values: np.ndarray, like: Any) -> Any:
        if isinstance(like, np.ndarray):
            return np.asarray(values)
        return Tensor(np.ascontiguousarray(values))

    def to_numpy(self, t: Any) -> np.ndarray:
        return t.asnumpy() if isinstance(t, Tensor) else np.asarray(t)

    def pad_dim(self, t: Any, dim: int, size: int, value: Any) -> Any:
        if isinstance(t, np.ndarray):
            widths = [(0, 0)] * t.ndim
            widths[dim] = (0, max(int(size) - t.shape[dim], 0))
            return np.pad(t, widths, constant_values=value)
        dim = int(dim) % len(t.shape)
        extra = int(size) - int(t.shape[dim])
        if extra <= 0:
            return t
        shape = (*t.shape[:dim], extra, *t.shape[dim + 1 :])
        return mint.cat([t, ops.full(tuple(int(s) for s in shape), value, dtype=t.dtype)], dim)
