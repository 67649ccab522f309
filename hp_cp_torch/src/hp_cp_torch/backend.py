"""Tensor ops and differentiable collectives on ``torch.distributed`` (gloo, NCCL).

Every exchange is one ``autograd.Function`` that takes the layer's order token and returns
the next (Note [Backward order] in :mod:`hp_cp_core.collectives`): an empty tensor in the
graph whose gradient only the next exchange's backward produces. So every rank runs every
backward collective, in reverse forward order, even when it received nothing or never used
what it received:

* :class:`_OrderBegin`: the first token, tied to the layer input (zero gradient).
* :class:`_HaloExchange`: one point-to-point message per peer carrying several tensors' rows
  as raw bytes: the window KV halo and the x halo (``halo_exchange``), or the compressed
  slots a peer's queries see, main and indexer (``slot_exchange``); backward returns the
  gradients of the received rows to their owners.
* :class:`_AllGatherRows`: all-gather of rows (``handle.unshard``; the compressed slots on a
  group without point-to-point, not this one); backward reduce-scatters.
* :class:`_OrderEnd`: identity on the layer output that starts the chain in backward.

A collective that fails or times out (a peer raised inside the layer and never joined it)
raises :class:`~hp_cp_core.HpCpError` naming the collective and this rank, chained from the
``torch.distributed`` error, within the process group's timeout, with the desync report:
where this rank waits and what every peer last entered (Note [Desync report] in
:mod:`hp_cp_torch.distributed.desync`).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hp_cp_core import HpCpError
from hp_cp_core.runners import InstallingBackend
from hp_cp_torch.distributed.desync import CollectiveLog, InLayer, group_store
from hp_cp_torch.distributed.exit import release_at_exit
from hp_cp_torch.distributed.forward_scope import CallScope, install_forward_scopes, mark_batch
from hp_cp_torch.kernels.registry import kernel_named

__all__ = ["TorchBackend", "TorchGroup", "resolve_process_group"]


def resolve_process_group(mesh: Any) -> Any:
    """The ``ProcessGroup`` of a 1-D ``DeviceMesh``, a named mesh dim, or a ``ProcessGroup``."""
    if not dist.is_available() or not dist.is_initialized():
        raise HpCpError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group "
            "(or init_device_mesh) on every rank before enable_cp."
        )
    if mesh is None:
        return dist.group.WORLD
    me = dist.get_rank()
    if isinstance(mesh, int) and mesh == getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
        raise HpCpError(
            f"enable_cp(mesh=...) got GroupMember.NON_GROUP_MEMBER on global rank {me}: "
            "dist.new_group(ranks) returns it on ranks outside `ranks`, so this process is not "
            "in that CP group. Pass each rank the group it belongs to (call new_group once per "
            "CP group on every rank and keep the one containing this rank), or mesh['cp']."
        )
    if isinstance(mesh, dist.ProcessGroup):
        if dist.get_rank(mesh) < 0:
            raise HpCpError(
                f"enable_cp(mesh=...) got a ProcessGroup of global ranks "
                f"{dist.get_process_group_ranks(mesh)} that this process (global rank {me}) "
                "is not a member of. Pass each rank the CP group that contains it."
            )
        return mesh
    get_group = getattr(mesh, "get_group", None)
    if get_group is not None and hasattr(mesh, "mesh"):  # DeviceMesh
        if mesh.ndim != 1:
            names = getattr(mesh, "mesh_dim_names", None)
            raise HpCpError(
                f"enable_cp needs a 1-D DeviceMesh for the CP dimension, got a {mesh.ndim}-D "
                f"mesh with dims {names}. Pass the CP dim, e.g. mesh['cp']."
            )
        return _mesh_group(mesh, me)
    raise HpCpError(
        f"enable_cp(mesh=...) got a {type(mesh).__name__}; expected a torch DeviceMesh (1-D or "
        "mesh['cp']) or a torch.distributed ProcessGroup."
    )


def _mesh_group(mesh: Any, me: int) -> Any:
    """The group of a 1-D ``DeviceMesh``, checked against the mesh: this rank is in it, and
    it holds exactly the mesh's ranks (a mesh and group that disagree would make the plan's
    cp size differ from the ranks that actually exchange)."""
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if me not in ranks:
        raise HpCpError(
            f"enable_cp(mesh=...) got a DeviceMesh of global ranks {ranks} that this process "
            f"(global rank {me}) is not part of. Pass each rank the CP mesh that contains it "
            "(init_device_mesh(...)['cp'] gives every rank its own)."
        )
    pg = mesh.get_group()
    group_ranks = dist.get_process_group_ranks(pg)
    if len(ranks) != len(group_ranks) or sorted(ranks) != sorted(group_ranks):
        raise HpCpError(
            f"enable_cp(mesh=...) got a DeviceMesh of size {len(ranks)} (global ranks {ranks}) "
            f"whose process group has size {len(group_ranks)} (global ranks {group_ranks}); "
            "the CP size must be the same for both. Build the mesh with init_device_mesh (or "
            "pass the ProcessGroup itself)."
        )
    return pg


def _peer_failure(group: TorchGroup, name: str, exc: BaseException, where: str) -> HpCpError:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    me = group.global_ranks[group.rank] if 0 <= group.rank < len(group.global_ranks) else "?"
    return HpCpError(
        f"CP collective {name} failed on rank {group.rank} of {group.size} (global rank {me}): "
        f"a peer rank likely failed or skipped it ({type(exc).__name__}: {first}). Desync "
        f"report: {group.log.report(where)}. Look for "
        "the first error on the other ranks; every rank must run each CP layer's forward and "
        "backward the same number of times. The wait is bounded by the process group's "
        "timeout (init_process_group(timeout=...) / new_group(timeout=...))."
    )


SEND_INDEX_CACHE = 256
"""Plans (per device) whose send-row index tensors a :class:`TorchGroup` keeps."""

_CURRENT = -1
"""``_collective(layer=...)``: the layer whose CP forward runs now."""


@contextlib.contextmanager
def _collective(group: TorchGroup, name: str, layer: int | None = _CURRENT) -> Iterator[None]:
    """Record entering collective ``name`` (for the desync report), and turn its failure or
    timeout into an :class:`HpCpError` naming it and where every rank is."""
    where = group.log.enter(name, group.log.layer if layer == _CURRENT else layer)
    try:
        yield
    except RuntimeError as exc:  # gloo / NCCL timeouts, closed connections (DistError)
        raise _peer_failure(group, name, exc, where) from exc


class TorchGroup:
    """A CP group on ``torch.distributed`` implementing the core's ``Group`` protocol."""

    point_to_point = True  # batched isend / irecv: compressed slots go point to point

    def __init__(self, pg: Any, scope: str = "") -> None:
        self.pg = pg
        self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)
        self.global_ranks = [dist.get_global_rank(pg, k) for k in range(self.size)]
        nccl = dist.get_backend(pg) == "nccl"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        )
        self.bytes_sent = self.bytes_recv = 0
        self.calls: dict[str, int] = {}
        self.regather_views = 0  # saved tensors kept as views to re-gather (RegatherScope)
        self.log = CollectiveLog(self.rank, self.size, group_store(self.global_ranks, scope))
        release_at_exit(self, "pg")  # and the log's store: Note [Clean exit]
        release_at_exit(self.log, "store")
        self.n_layers = 0  # installed so far; a layer's index in the desync report
        self.closed = False  # disable_cp ran (its record is published)
        self.link: Any = None  # a benchmark's slow-link model wrapping the p2p work handles
        self._send_index: collections.OrderedDict[tuple[int, str], tuple[Any, list]] = (
            collections.OrderedDict()
        )

    def send_index(self, plan: Any, peer: int, device: torch.device) -> torch.Tensor:
        """``plan.send_rows[peer]`` as a device index tensor, cached per plan and device (no
        host-to-device copy per layer call; the plan is kept alive with its entry)."""
        key = (id(plan), str(device))
        hit = self._send_index.get(key)
        if hit is None or hit[0] is not plan:
            hit = self._send_index[key] = (plan, [_index(r, device) for r in plan.send_rows])
            while len(self._send_index) > SEND_INDEX_CACHE:
                self._send_index.popitem(last=False)
        else:
            self._send_index.move_to_end(key)
        return hit[1][peer]

    def count(self, kind: str, sent: int, recv: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_recv += int(recv)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def begin_order(self, anchor: torch.Tensor) -> torch.Tensor | None:
        if not torch.is_grad_enabled():
            return None
        if anchor is not None and anchor.requires_grad:
            return _OrderBegin.apply(anchor)
        # nothing upstream to order against: a leaf still puts every exchange in the graph
        return torch.empty(0, device=self.device, requires_grad=True)

    def end_order(self, output: Any, token: torch.Tensor | None, regather: Any = None) -> Any:
        if token is None or not token.requires_grad:
            return output
        if isinstance(output, torch.Tensor):
            return _attach_token(output, token, regather)
        if isinstance(output, (tuple, list)):
            parts = list(output)
            for i, part in enumerate(parts):
                if isinstance(part, torch.Tensor) and part.is_floating_point():
                    parts[i] = _attach_token(part, token, regather)
                    return type(output)(parts) if isinstance(output, list) else tuple(parts)
        raise HpCpError(
            f"the CP attention hook returned a {type(output).__name__}; expected the layer "
            "output tensor (or a tuple starting with it) so the backward order token can be "
            "attached to it."
        )

    def exchange_rows(
        self, items: Sequence[tuple[torch.Tensor, Any]], token: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        plans = [plan for _, plan in items]
        token, *outs = _HaloExchange.apply(self, plans, token, *[t for t, _ in items])
        return outs, _token_or_none(token)

    def all_gather_rows(
        self, tensor: torch.Tensor, token: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        token, out = _AllGatherRows.apply(self, token, tensor)
        return out, _token_or_none(token)

    def regather_scope(
        self, buffers: Sequence[torch.Tensor], owned: Sequence[torch.Tensor], rebuild: Any
    ) -> RegatherScope:
        """Keep ``buffers`` out of what autograd saves in the scope; its ``end_order``'s
        backward receives them again (Note [Re-gathered slots] in
        :mod:`hp_cp_core.compression`)."""
        return RegatherScope(self, buffers, owned, rebuild)

    def all_gather_dim(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        rows = tensor.movedim(dim, 0)
        shape = rows.shape
        out, _ = self.all_gather_rows(rows.reshape(shape[0], -1), None)
        return out.reshape(self.size * shape[0], *shape[1:]).movedim(0, dim)

    def all_gather_meta(self, values: np.ndarray, device_flags: Sequence[Any] = ()) -> np.ndarray:
        """``[n]`` int64 -> ``[size, n + len(device_flags)]``: the device flags (0-dim tensors
        or bools, not read by the caller) are appended on the device, so the gather's one
        host read returns them too (``LocalCheck.deferred``)."""
        local = torch.as_tensor(np.asarray(values, dtype=np.int64), device=self.device)
        if len(device_flags):
            flags = [torch.as_tensor(f, device=self.device).reshape(1) for f in device_flags]
            local = torch.cat([local, torch.cat(flags).to(torch.int64)])
        out = torch.empty(self.size * local.numel(), dtype=torch.int64, device=self.device)
        with _collective(self, "all_gather_meta"):
            _all_gather_single(out, local, self.pg)
        return out.view(self.size, -1).cpu().numpy()

    def sum_detached(self, tensor: torch.Tensor) -> torch.Tensor:
        """A small tensor summed over the ranks, outside autograd (a logged value such as the
        indexer loss). An all-reduce on the tensor's device: no host sync on GPU."""
        out = tensor.detach().clone()
        with _collective(self, "all_reduce"):
            dist.all_reduce(out, group=self.pg)
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_recv": self.bytes_recv,
            "collectives": dict(self.calls),
            "regather_saved_views": self.regather_views,
        }

    # -- point-to-point with byte payloads --------------------------------------------------
    def p2p(
        self,
        sends: dict[int, torch.Tensor],
        recv_sizes: dict[int, int],
        name: str = "p2p",
        layer: int | None = _CURRENT,
    ) -> dict:
        """Send ``sends[peer]`` (uint8) and receive ``recv_sizes[peer]`` bytes from each peer.

        Recorded as entered (desync report) on every rank, with or without messages, so the
        ranks' collective numbers stay aligned."""
        pending = _Pending(self, [], layer)
        pending.start(sends, recv_sizes, name)
        return pending.finish(name)

    def start_p2p(self, ops: list[Any]) -> list[Any]:
        """Issue ``ops`` (``dist.P2POp``) in one batch; their work handles. With a ``link``
        (a benchmark's model of a slow link, see :mod:`hp_cp_torch.bench.overlap`) the handles
        are the link's, completing only after its delay."""
        works = dist.batch_isend_irecv(ops) if ops else []
        return works if self.link is None else self.link(works)

    def issue_rows(
        self, items: Sequence[tuple[torch.Tensor, Any]], token: torch.Tensor | None
    ) -> tuple[Any, torch.Tensor | None]:
        """The first half of :meth:`exchange_rows`: the messages leave, receives are posted;
        returns what :meth:`wait_rows` completes (Note [Overlapped exchanges] in
        :mod:`hp_cp_core.collectives`)."""
        pending = _Pending(self, [plan for _, plan in items])
        tensors = [t for t, _ in items]
        token = _IssueRows.apply(pending, token, *tensors)
        pending.tensors = tensors
        return pending, _token_or_none(token)

    def wait_rows(
        self, pending: Any, token: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The second half: wait for the messages; ``[received rows ; local]`` per item, as
        :meth:`exchange_rows` returns them, and the next token."""
        tensors, pending.tensors = pending.tensors, None
        token, *outs = _WaitRows.apply(pending, token, *tensors)
        return outs, _token_or_none(token)


def _all_gather_single(out: torch.Tensor, tensor: torch.Tensor, pg: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=pg)


def _new_token(device: torch.device) -> torch.Tensor:
    """An order token: an empty tensor; a Function output, so it carries the graph edge."""
    return torch.empty(0, device=device)


def _token_or_none(token: torch.Tensor | None) -> torch.Tensor | None:
    return token if token is not None and token.requires_grad else None


def _token_grad(ctx: Any, index: int, device: torch.device) -> torch.Tensor | None:
    """The (empty) gradient of the token input ``index``; ``None`` when it had none."""
    return torch.zeros(0, device=device) if ctx.needs_input_grad[index] else None


def _attach_token(output: torch.Tensor, token: torch.Tensor, regather: Any = None) -> torch.Tensor:
    if not (torch.is_grad_enabled() and output.is_floating_point()):
        return output
    return _OrderEnd.apply(output, token, regather)


class _SavedCell:
    """The re-gathered buffers of one layer forward, shared by its :class:`_SavedView`
    handles; it lives exactly as long as one of them does (autograd frees a node's saved
    handles after the node ran), so the buffers go when the layer's last reader is done."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] | None = None


class _SavedView:
    """What autograd keeps in place of a saved view of a re-gathered buffer."""

    __slots__ = ("cell", "index", "offset", "size", "stride")

    def __init__(self, cell: _SavedCell, index: int, t: torch.Tensor) -> None:
        self.cell, self.index = cell, index
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()


class _OuterSaved:
    """A saved tensor packed by the hooks that were active outside the scope (a user's
    offload or checkpoint hooks), to be unpacked by them."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Any) -> None:
        self.packed, self.unpack = packed, unpack


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (a functional or sparse tensor)
        return None
    return (st.data_ptr(), st.nbytes()) if st.nbytes() else None


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    key = _storage_key(t)
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, key[1] if key else 0)


class RegatherScope:
    """One layer forward's ``regather_scope`` (Note [Re-gathered slots] in
    :mod:`hp_cp_core.compression`): while it is entered, a saved tensor sharing storage with
    a buffer (the global compressed KV, the indexer keys, or a view of them) is kept as a
    :class:`_SavedView`; every other saved tensor as the hooks outside the scope keep it (as
    itself when there are none). :meth:`end_order` attaches the node whose backward runs
    ``rebuild(owned)`` and hands the result to the views."""

    def __init__(
        self,
        group: TorchGroup,
        buffers: Sequence[torch.Tensor],
        owned: Sequence[torch.Tensor],
        rebuild: Any,
    ) -> None:
        self.group, self.rebuild = group, rebuild
        self.layer = group.log.layer
        self.owned = [t.detach() for t in owned]  # this rank's slots: O(L / r) rows
        self.layouts = [_layout(b) for b in buffers]
        self._sources = {_storage_key(b): i for i, b in enumerate(buffers) if _storage_key(b)}
        self._cell: _SavedCell | None = _SavedCell()
        self._cell_ref = weakref.ref(self._cell)
        self._hooks: Any = None
        self._outer: Any = None

    def __enter__(self) -> RegatherScope:
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self._outer = top(False) if top is not None else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks, self._cell, self._sources = None, None, {}  # the views keep the cell

    def _pack(self, t: torch.Tensor) -> Any:
        index = self._sources.get(_storage_key(t)) if self._sources else None
        if index is not None and self._cell is not None:
            self.group.regather_views += 1
            return _SavedView(self._cell, index, t)
        if self._outer is not None:
            pack, unpack = self._outer
            return _OuterSaved(pack(t), unpack)
        return t

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _SavedView):
            buffers = saved.cell.buffers
            if buffers is None:
                raise HpCpError(
                    "a CP layer's attention backward ran before the layer's output backward "
                    "re-gathered its compressed slots (CPConfig("
                    "regather_compressed_kv=True)): something reached the attention's graph "
                    "without going through the layer's output. Back-propagate through the "
                    "layer output only, or turn the option off."
                )
            return buffers[saved.index].as_strided(saved.size, saved.stride, saved.offset)
        return saved.unpack(saved.packed) if isinstance(saved, _OuterSaved) else saved

    def end_order(self, output: Any, token: torch.Tensor | None) -> Any:
        """The group's ``end_order``, with the re-gather in its backward."""
        return self.group.end_order(output, token, regather=self)

    def regather(self) -> None:
        """Receive the buffers again (every rank, whether or not it kept a view: its peers
        may read its slots) and hand them to the views still alive."""
        log = self.group.log
        previous, log.layer = log.layer, self.layer
        try:
            with torch.no_grad():
                buffers = list(self.rebuild(self.owned))
        finally:
            log.layer = previous
        cell = self._cell_ref()
        if cell is None:
            return  # no view left (nothing saved a buffer, or their nodes already ran)
        got = [_layout(b) for b in buffers]
        if got != self.layouts:
            raise HpCpError(
                f"re-gathered compressed slots have layouts {got}, the forward's were "
                f"{self.layouts}; the saved views cannot be restored. This is a bug in the "
                "backend's regather; CPConfig(regather_compressed_kv=False) avoids it."
            )
        cell.buffers = buffers


class _OrderBegin(torch.autograd.Function):
    """The first token of a layer, from its input; backward: a zero gradient for the input
    that exists only after the layer's first exchange ran its backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor) -> torch.Tensor:
        ctx.anchor_meta = (anchor.shape, anchor.dtype, anchor.device)
        return _new_token(anchor.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        shape, dtype, device = ctx.anchor_meta
        return torch.zeros((), dtype=dtype, device=device).expand(shape)


class _OrderEnd(torch.autograd.Function):
    """Identity on the layer output; backward hands the last token its (empty) gradient, which
    starts the layer's backward exchanges, last to first. With a :class:`RegatherScope`, the
    backward first re-gathers the layer's compressed slots (the first backward of the layer
    on every rank: Note [Re-gathered slots])."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, token: torch.Tensor, scope: Any) -> torch.Tensor:
        ctx.token_device, ctx.scope = token.device, scope
        # detach, not view_as: the result behaves like ``output`` itself (in-place ops on it
        # are checked by the shared version counter, not refused as custom-Function views)
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.scope is not None:
            ctx.scope.regather()
        return grad, torch.zeros(0, device=ctx.token_device), None


def _row_bytes(t: torch.Tensor) -> int:
    return int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _from_bytes(buf: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    return buf.view(like.dtype).view(rows, *like.shape[1:])


def _index(plan_rows: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(plan_rows, dtype=torch.long, device=device)


class _HaloExchange(torch.autograd.Function):
    """``[received rows (source-rank order) ; local]`` per item, one message per peer."""

    @staticmethod
    def forward(ctx: Any, group: TorchGroup, plans: list[Any], token: Any, *tensors: torch.Tensor):
        ctx.pending = pending = _Pending(group, plans)
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        pending.issue(tensors)
        return (_new_token(group.device), *_assemble(pending.finish(), plans, tensors))

    @staticmethod
    def backward(ctx: Any, _token_grad_out: torch.Tensor, *grads: torch.Tensor):
        pending, group, plans = ctx.pending, ctx.pending.group, ctx.pending.plans
        grads, like = _full_grads(grads, plans, ctx.shapes), _row_likes(ctx.shapes)
        pending.issue_grads(grads, like)  # to the ranks that sent those rows
        out = [g[p.n_halo :].clone() for g, p in zip(grads, plans)]
        _add_sent_rows_grads(out, pending.finish(backward=True), like, plans, group)
        return (None, None, _token_grad(ctx, 2, group.device), *out)


class _Pending:
    """One exchange between :meth:`TorchGroup.issue_rows` and :meth:`TorchGroup.wait_rows`
    (and between its backward halves): the work handles, the buffers, where it was entered."""

    def __init__(self, group: TorchGroup, plans: list[Any], layer: int | None = _CURRENT) -> None:
        self.group, self.plans = group, plans
        # halo_exchange or slot_exchange: the plans' name, for counters and errors
        self.name = getattr(next(iter(plans), None), "exchange_name", "halo_exchange")
        self.layer = group.log.layer if layer == _CURRENT else layer
        self.tensors: list[torch.Tensor] | None = None
        self.works: list[Any] = []
        self.recvs: dict[int, torch.Tensor] = {}
        self.sends: dict[int, torch.Tensor] = {}  # kept alive until the wait
        self.where = ""

    def start(self, sends: dict[int, torch.Tensor], recv_sizes: dict[int, int], name: str) -> None:
        group = self.group
        ops = []
        self.sends, self.recvs = sends, {}
        for peer, buf in sends.items():
            ops.append(dist.P2POp(dist.isend, buf, group.global_ranks[peer], group.pg))
        for peer, n in recv_sizes.items():
            self.recvs[peer] = torch.empty(n, dtype=torch.uint8, device=group.device)
            ops.append(dist.P2POp(dist.irecv, self.recvs[peer], group.global_ranks[peer], group.pg))
        self.where = group.log.enter(name, self.layer)
        try:
            self.works = group.start_p2p(ops)
        except RuntimeError as exc:
            raise _peer_failure(group, name, exc, self.where) from exc

    def issue(self, tensors: Sequence[torch.Tensor]) -> None:
        """Start the forward messages: the rows ``tensors`` send each peer."""
        sends, recv_sizes = _forward_messages(self.group, self.plans, tensors)
        self.start(sends, recv_sizes, self.name)
        self.group.count(
            self.name, sum(b.numel() for b in sends.values()), sum(recv_sizes.values())
        )

    def issue_grads(self, grads: list[torch.Tensor], like: list[torch.Tensor]) -> None:
        """Start the backward messages: the received rows' gradients go back to their owners."""
        sends, recv_sizes = _backward_messages(self.group, self.plans, grads, like)
        self.start(sends, recv_sizes, f"{self.name} backward")
        sent = sum(b.numel() for b in sends.values())
        self.group.count(f"{self.name}_bwd", sent, sum(recv_sizes.values()))

    def finish(self, name: str | None = None, backward: bool = False) -> dict[int, torch.Tensor]:
        name = name or (f"{self.name} backward" if backward else self.name)
        works, self.works = self.works, []
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise _peer_failure(self.group, name, exc, self.where) from exc
        self.sends = {}
        recvs, self.recvs = self.recvs, {}
        return recvs


def _forward_messages(group: TorchGroup, plans: list[Any], tensors: Sequence[torch.Tensor]):
    """Per peer: the bytes of the rows ``tensors`` send it, and the bytes it sends back."""
    sends, recv_sizes = {}, {}
    for peer in range(group.size):
        parts = [
            _as_bytes(t[group.send_index(p, peer, t.device)])
            for t, p in zip(tensors, plans)
            if p.send_rows[peer].size
        ]
        if parts:
            sends[peer] = torch.cat(parts)
        n = sum(p.recv_counts[peer] * _row_bytes(t) for t, p in zip(tensors, plans))
        if n:
            recv_sizes[peer] = n
    return sends, recv_sizes


def _assemble(recvs: dict[int, torch.Tensor], plans: list[Any], tensors: Sequence[torch.Tensor]):
    """``[received rows (source-rank order) ; local]`` per tensor."""
    offsets = dict.fromkeys(recvs, 0)
    pieces: list[list[torch.Tensor]] = [[] for _ in tensors]
    for peer in sorted(recvs):
        for i, (t, p) in enumerate(zip(tensors, plans)):
            n = p.recv_counts[peer]
            if n:
                nb = n * _row_bytes(t)
                buf = recvs[peer][offsets[peer] : offsets[peer] + nb]
                pieces[i].append(_from_bytes(buf, t, n))
                offsets[peer] += nb
    return [torch.cat([*got, t]) if got else t.clone() for t, got in zip(tensors, pieces)]


def _full_grads(grads: Sequence[Any], plans: list[Any], shapes: list[Any]) -> list[torch.Tensor]:
    """The gradients of ``[received ; local]`` per tensor, zeros where autograd gave none."""
    return [
        torch.zeros((p.n_halo + s[0][0], *s[0][1:]), dtype=s[1], device=s[2]) if g is None else g
        for g, p, s in zip(grads, plans, shapes)
    ]


def _row_likes(shapes: list[Any]) -> list[torch.Tensor]:
    """Empty tensors with each exchanged tensor's row shape, dtype and device."""
    return [torch.empty((0, *s[0][1:]), dtype=s[1], device=s[2]) for s in shapes]


def _add_sent_rows_grads(
    outs: list[torch.Tensor | None], recvs: dict[int, torch.Tensor], like, plans, group
) -> None:
    """Add the gradients peers returned for the rows this rank sent them into ``outs`` (a
    ``None`` entry: that tensor needs none; its bytes are skipped)."""
    for peer in sorted(recvs):
        off = 0
        for i, (t, p) in enumerate(zip(like, plans)):
            rows = p.send_rows[peer]
            if rows.size:
                nb = rows.size * _row_bytes(t)
                if outs[i] is not None:
                    got = _from_bytes(recvs[peer][off : off + nb], t, rows.size)
                    outs[i].index_add_(0, group.send_index(p, peer, got.device), got)
                off += nb


def _backward_messages(group: TorchGroup, plans: list[Any], grads, like):
    """Per peer: the gradient bytes of the rows received from it, and the bytes coming back."""
    starts = [0] * len(plans)
    per_peer: dict[int, list[torch.Tensor]] = {}
    for peer in range(group.size):
        for i, (g, p) in enumerate(zip(grads, plans)):
            n = p.recv_counts[peer]
            if n:
                per_peer.setdefault(peer, []).append(_as_bytes(g[starts[i] : starts[i] + n]))
                starts[i] += n
    sends = {peer: torch.cat(parts) for peer, parts in per_peer.items()}
    recv_sizes = {}
    for peer in range(group.size):
        n = sum(p.send_rows[peer].size * _row_bytes(t) for t, p in zip(like, plans))
        if n:
            recv_sizes[peer] = n
    return sends, recv_sizes


class _IssueRows(torch.autograd.Function):
    """The issue half of an overlapped exchange; backward waits for the gradients of the
    rows this rank sent and returns them (Note [Overlapped exchanges])."""

    @staticmethod
    def forward(ctx: Any, pending: _Pending, token: Any, *tensors: torch.Tensor):
        ctx.pending = pending
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        pending.issue(tensors)
        return _new_token(pending.group.device)

    @staticmethod
    def backward(ctx: Any, _token_grad_out: torch.Tensor):
        pending, group = ctx.pending, ctx.pending.group
        recvs = pending.finish(backward=True)
        outs = [
            torch.zeros(shape, dtype=dtype, device=device) if ctx.needs_input_grad[2 + i] else None
            for i, (shape, dtype, device) in enumerate(ctx.shapes)
        ]
        _add_sent_rows_grads(outs, recvs, _row_likes(ctx.shapes), pending.plans, group)
        return (None, _token_grad(ctx, 1, group.device), *outs)


class _WaitRows(torch.autograd.Function):
    """The wait half: ``[received ; local]`` per tensor; backward issues the gradients of the
    received rows to their owners and returns the local rows' gradients at once."""

    @staticmethod
    def forward(ctx: Any, pending: _Pending, token: Any, *tensors: torch.Tensor):
        ctx.pending = pending
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        recvs = pending.finish()
        return (_new_token(pending.group.device), *_assemble(recvs, pending.plans, tensors))

    @staticmethod
    def backward(ctx: Any, _token_grad_out: torch.Tensor, *grads: torch.Tensor):
        pending, group, plans = ctx.pending, ctx.pending.group, ctx.pending.plans
        grads, like = _full_grads(grads, plans, ctx.shapes), _row_likes(ctx.shapes)
        pending.issue_grads(grads, like)
        local = [
            g[p.n_halo :] if ctx.needs_input_grad[2 + i] else None
            for i, (g, p) in enumerate(zip(grads, plans))
        ]
        return (None, _token_grad(ctx, 1, group.device), *local)


class _AllGatherRows(torch.autograd.Function):
    """``[cap, F]`` from every rank -> ``[size * cap, F]``; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, group: TorchGroup, token: Any, tensor: torch.Tensor):
        ctx.group, ctx.layer = group, group.log.layer
        tensor = tensor.contiguous()
        out = tensor.new_empty((group.size * tensor.shape[0], *tensor.shape[1:]))
        with _collective(group, "all_gather"):
            _all_gather_single(out, tensor, group.pg)
        nbytes = tensor.numel() * tensor.element_size()
        group.count("all_gather", nbytes if group.size > 1 else 0, nbytes * (group.size - 1))
        return _new_token(group.device), out

    @staticmethod
    def backward(ctx: Any, _token_grad_out: torch.Tensor, grad: torch.Tensor):
        group = ctx.group
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // group.size, *grad.shape[1:]))
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        with _collective(group, "all_gather backward (reduce_scatter)", ctx.layer):
            reduce_scatter(out, grad, group=group.pg)
        nbytes = out.numel() * out.element_size()
        group.count("all_gather_bwd", nbytes * (group.size - 1), nbytes * (group.size - 1))
        return None, _token_grad(ctx, 1, group.device), out


class _Restore:
    """What :meth:`TorchBackend.install` returns: the layer's restore, and its group."""

    def __init__(self, restore: Any, group: TorchGroup) -> None:
        self.restore, self.group = restore, group

    def __call__(self) -> None:
        self.restore()


class TorchBackend(InstallingBackend):
    """The torch backend: ops for the core helpers, groups, and forward install."""

    name = "torch"

    def __init__(self, find: Any, install: Any, prepare: Any = None) -> None:
        super().__init__(find, install)
        self._prepare = prepare

    def group(self, mesh: Any) -> TorchGroup:
        """A :class:`TorchGroup`; its desync records are scoped by the process group's name
        and this group's number on it (the same on every rank running the same program)."""
        pg = resolve_process_group(mesh)
        name = str(dist.distributed_c10d._get_process_group_name(pg))
        handles = self.__dict__.setdefault("_handles_per_pg", {})
        handles[name] = handles.get(name, 0) + 1
        return TorchGroup(pg, f"{name}.{handles[name]}")

    def uninstall(self, layer: Any, token: Any) -> None:
        """Restore ``layer``; the handle's first uninstall publishes this rank's last
        collective (a peer left waiting in one reports where this rank stopped)."""
        group = token.group if isinstance(token, _Restore) else None
        if group is not None and not group.closed:
            group.closed = True
            group.log.publish()
        super().uninstall(layer, token)

    def prepare_module(self, module: Any, layers: list[Any], handle: Any) -> None:
        """Check the config's attention kernel is registered (an ``HpCpError`` listing the
        registered ones, before anything is installed or exchanged), then what the model needs
        beyond its attention layers (the ``prepare`` given at construction: the model
        adapters' ``prepare_model``, :func:`hp_cp_torch.adapter.prepare_module`)."""
        kernel_named(handle.config.attention_kernel)
        release_at_exit(handle, "mesh")  # the group passed to enable_cp: Note [Clean exit]
        if self._prepare is not None:
            self._prepare(module, layers, handle)
        if isinstance(module, torch.nn.Module):
            handle.on_disable(install_forward_scopes(module, layers, handle.records))

    def mark_batch(self, tensor: Any, records: Any, sequence: Any) -> None:
        """A forward given ``tensor`` reads the padding record ``sequence`` (Note [Records
        per forward] in :mod:`hp_cp_core.records`)."""
        mark_batch(tensor, records, sequence)

    def install(self, layer: Any, cp_forward: Any, group: TorchGroup) -> Any:
        """Install ``layer`` with a CP forward that names it (by its index among the
        handle's layers) in the collectives it enters: see :mod:`hp_cp_torch.distributed.desync`."""
        group.n_layers += 1
        config = getattr(cp_forward, "config", None)
        if config is not None and not config.desync_report:
            group.log.store = None  # keep only this rank's own record
        restore = super().install(layer, InLayer(cp_forward, group.log, group.n_layers - 1), group)
        installed = getattr(layer, "__dict__", {}).get("forward")
        records = getattr(cp_forward, "records", None)
        if hasattr(installed, "scope") and records is not None:
            installed.scope = CallScope(records, cp_forward.index)
        return _Restore(restore, group)

    # ops (dim 0 = rows); index arrays arrive as numpy
    def cat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(tensors))

    def narrow(self, t: torch.Tensor, start: int, length: int) -> torch.Tensor:
        return t.narrow(0, start, length)

    def index_rows(self, t: torch.Tensor, index: np.ndarray) -> torch.Tensor:
        return t.index_select(0, _index(index, t.device))

    def num_rows(self, t: torch.Tensor) -> int:
        return int(t.shape[0])

    def flatten_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], int(np.prod(t.shape[1:], dtype=np.int64)))

    def unflatten_rows(self, t: torch.Tensor, like_shape: tuple[int, ...]) -> torch.Tensor:
        return t.reshape(like_shape)

    def cat_features(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(tensors), dim=1)

    def split_features(self, t: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        return list(t.split(list(sizes), dim=1))

    def pad_rows(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))

    def shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.shape)

    def take(self, t: torch.Tensor, index: np.ndarray, dim: int) -> torch.Tensor:
        return t.index_select(dim, _index(index, t.device))

    def as_tensor(self, values: np.ndarray, like: torch.Tensor | None) -> torch.Tensor:
        return torch.as_tensor(values, device=None if like is None else like.device)

    def to_numpy(self, t: Any) -> np.ndarray:
        return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)

    def pad_dim(self, t: torch.Tensor, dim: int, size: int, value: Any) -> torch.Tensor:
        dim = dim % t.dim()
        extra = int(size) - int(t.shape[dim])
        if extra <= 0:
            return t
        shape = (*t.shape[:dim], extra, *t.shape[dim + 1 :])
        return torch.cat([t, t.new_full(shape, value)], dim=dim)
