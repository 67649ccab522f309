"""``enable_cp`` / ``disable_cp`` and the handle they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hp_cp_core.backend import Backend, Group
from hp_cp_core.batch import CPBatch, batch_digest, plan_batch
from hp_cp_core.collectives import slot_exchange_kind
from hp_cp_core.config import CPConfig, LayerSpec
from hp_cp_core.errors import BackendNotFoundError, HpCpError
from hp_cp_core.forward import CPForward
from hp_cp_core.layout import SequenceLayout
from hp_cp_core.padding import CPPadding, ShardedSequence, pad_for_cp
from hp_cp_core.plan import PlanCache
from hp_cp_core.plugins import PluginHost, get_plugin_host
from hp_cp_core.records import ForwardRecords
from hp_cp_core.sharing import SharedState, SharingPlan, plan_sharing
from hp_cp_core.validation import AgreementMemo, check_group, check_layer_spec
from hp_cp_core.versions import check_api_usable, check_group_api

_MARK = "_hp_cp_handle"


@dataclass
class CPHandle:
    """What ``enable_cp`` returns: lays tensors out for this rank and reports traffic.

    Attributes:
        module: the module passed to ``enable_cp``.
        mesh: the mesh passed to ``enable_cp``.
        backend_name: the chosen backend.
        backend: the backend object.
        group: the CP group.
        config: the options.
        layers: the attention layers running under CP, with their specs.

    A handle (and so a module running under CP, which refers to it) cannot be pickled or
    copied: it holds this process's CP group. See :func:`cp_state_not_copyable`.
    """

    module: Any
    mesh: Any
    backend_name: str
    backend: Backend
    group: Group
    config: CPConfig
    layers: list[tuple[Any, LayerSpec]] = field(default_factory=list)
    cache: PlanCache = field(default_factory=PlanCache)
    agreements: AgreementMemo = field(default_factory=AgreementMemo)
    """What the ranks agreed (Note [Validate, agree, then communicate]): its ``collectives``
    and ``reused`` count agreements run and skipped."""
    sequence: ShardedSequence = field(default_factory=ShardedSequence)
    """The padding of the sequence :meth:`shard` cut last: the indexer loss leaves those
    padding rows out (Note [Padding to the layout])."""
    sharing: SharingPlan | None = None
    """Which layer owns each compressed KV, index-key set and selection, and which layers
    reuse it (Note [Layers that share their indexer] in :mod:`hp_cp_core.sharing`);
    ``sharing.describe()`` is the table as data."""
    records: ForwardRecords | None = None
    """Each forward's own record (its batch's padding, what its owner layers published),
    and which one a layer call reads (Note [Records per forward] in
    :mod:`hp_cp_core.records`)."""
    _tokens: list[tuple[Any, Any]] = field(default_factory=list)
    _cleanups: list[Callable[[], None]] = field(default_factory=list)
    _kept_forwards: list[Any] = field(default_factory=list)
    active: bool = True

    def __post_init__(self) -> None:
        if self.records is None:
            self.records = ForwardRecords(self.sequence)

    @property
    def shared(self) -> SharedState:
        """What the owners published in the current forward, for the layers that reuse it."""
        current = self.records.current
        return current.shared if current is not None else SharedState()

    @property
    def bypassed(self) -> bool:
        """True while the layers keep their own forward: a CP group of one with
        ``single_rank_bypass`` (the default), until :meth:`use_cp_path`."""
        return bool(self._kept_forwards)

    def use_cp_path(self) -> None:
        """Route a group of one through the CP path from now on, as on more ranks.

        With ``single_rank_bypass`` a group of one keeps each layer's own forward, which is
        exact for what that forward takes. The batch helpers call this for inputs it cannot
        take (packed documents: a model's own forward ignores hp_cp's ``cu_seqlens``, and
        its tokens would attend across documents). Does nothing when nothing is bypassed.
        """
        kept, self._kept_forwards = self._kept_forwards, []
        for cp_forward in kept:
            cp_forward.config = replace(cp_forward.config, single_rank_bypass=False)
            undo = self.backend.install(cp_forward.module, cp_forward, self.group)
            self._tokens.append((cp_forward.module, undo))

    def on_disable(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` in ``disable_cp``, after the forwards are restored.

        For what a backend attaches to a module besides its forward (an explicit adapter),
        so that ``disable_cp`` leaves no attribute behind.
        """
        self._cleanups.append(fn)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise cp_state_not_copyable(type(self.module).__name__)

    @property
    def cp_rank(self) -> int:
        return self.group.rank

    @property
    def cp_size(self) -> int:
        return self.group.size

    def layout(self, total_rows: int) -> SequenceLayout:
        """The row layout of a sequence of ``total_rows`` rows over this CP group."""
        return SequenceLayout(self.config.layout, self.cp_size, int(total_rows))

    def padding(self, rows: int) -> CPPadding:
        """The padding a sequence of ``rows`` rows needs under this group and layout.

        ``.padded_rows`` (what ``shard(..., pad_value=...)`` pads to), ``.pad_rows``,
        ``.cu_seqlens(cu)`` (packed boundaries with the padding as its own trailing document)
        and ``.real_rows()``. See Note [Padding to the layout] in :mod:`hp_cp_core.padding`.
        """
        return pad_for_cp(rows, self.cp_size, self.config.layout)

    def shard(self, tensor: Any, seq_dim: int = 1, *, pad_value: Any = None) -> Any:
        """This rank's rows of a full-sequence tensor (inputs, position_ids, labels).

        The length must suit the layout (a multiple of cp, of 2 * cp load-balanced) unless
        ``pad_value`` is given: then the sequence is first padded at the end to
        ``self.padding(length).padded_rows`` with that value (0 for inputs, the ignore
        index for labels, 0 on a tensor of ones for a loss mask).

        A call with ``pad_value`` records the sequence's real and padded length
        (:attr:`sequence`): a layer forward over that padded length leaves the padding rows
        out of the indexer loss. A call without it, on a tensor of another length, clears
        the record (a tensor of the padded length, such as ``arange(padded_rows)``
        positions, belongs to the recorded sequence).

        The returned rows belong to that record: a forward given them (or given tensors
        ``handle.batch`` cut) reads its padding whatever was cut since, and checks that its
        layers see that sequence's length: ``seq_dim`` naming another dimension (the batch
        of a sequence-major ``[S, B, hidden]`` tensor, say) raises the same ``HpCpError``
        on every rank (Note [Records per forward] in :mod:`hp_cp_core.records`).
        """
        total = self.backend.shape(tensor)[seq_dim]
        real = total
        if pad_value is not None:
            pad = self.padding(total)
            if pad.pad_rows:
                pad_dim = getattr(self.backend, "pad_dim", None)
                if pad_dim is None:
                    raise HpCpError(
                        f"backend {self.backend_name!r} has no pad_dim op, so shard(..., "
                        f"pad_value=...) cannot pad; pad the sequence to {pad.padded_rows} "
                        "rows yourself (handle.padding(rows).padded_rows)."
                    )
                tensor = pad_dim(tensor, seq_dim, pad.padded_rows, pad_value)
                total = pad.padded_rows
            self.sequence.record(real, total)
        else:
            self.sequence.forget_unless(total)
        self.sequence.cut_rows = total
        index = self.layout(total).shard_index(self.cp_rank)
        local = self.backend.take(tensor, index, seq_dim)
        self._mark(local)
        return local

    def _mark(self, *tensors: Any) -> None:
        """Tell the backend that ``tensors`` belong to the sequence recorded last, so that a
        forward given them reads that sequence's padding whatever was cut since (Note
        [Records per forward] in :mod:`hp_cp_core.records`; an optional backend op)."""
        mark = getattr(self.backend, "mark_batch", None)
        if mark is not None:
            for tensor in tensors:
                if tensor is not None:
                    mark(tensor, self.records, self.sequence)

    def batch(
        self,
        input_ids: Any,
        *,
        labels: Any = None,
        cu_seqlens: Any = None,
        ignore_index: int = -100,
    ) -> CPBatch:
        """This rank's part of a causal-LM batch of any length: padded, shifted, sharded.

        Every stack's one batch path (Note [One batch path] in :mod:`hp_cp_core.batch`):
        positions per document, the padding, the labels shifted on the full sequence, the
        token count and the packed boundaries are planned once in numpy.

        Args:
            input_ids: the FULL token ids ``[B, S]`` (``[1, S]`` when packed).
            labels: the FULL labels, unshifted, shaped as ``input_ids`` (default: the ids).
            cu_seqlens: packed document boundaries ``[0, ..., S]`` (a sequence, array or
                tensor), or ``None``; each document's positions restart at 0 and its last
                token has no target.
            ignore_index: the label value the loss skips (the padding and every row without
                a target get it).

        Returns:
            A :class:`~hp_cp_core.batch.CPBatch`: ``input_ids``, ``position_ids``,
            ``labels`` (this rank's rows), ``n_tokens`` (targets of the whole batch),
            ``cu_seqlens`` (global, padding included, or ``None``); ``model_inputs()`` is
            the model call's keyword arguments.

        On a group of one with ``single_rank_bypass``, a packed batch or one the layout
        pads runs the CP path (:meth:`use_cp_path`): a model's own forward reads neither
        hp_cp's boundaries nor which rows are padding.

        Raises:
            HpCpError: ids that are not 2-D, labels of another shape, packed input of batch
                above 1, bad boundaries (a :class:`~hp_cp_core.errors.PlanError`), or a
                backend without the ``as_tensor`` / ``to_numpy`` ops.
        """
        shape = tuple(self.backend.shape(input_ids))
        if len(shape) != 2:
            raise HpCpError(
                f"input_ids must be the full token ids [B, S] (2-D); got shape {list(shape)}."
            )
        labels = input_ids if labels is None else labels
        if tuple(self.backend.shape(labels)) != shape:
            raise HpCpError(
                f"labels {list(self.backend.shape(labels))} must have the shape of input_ids "
                f"{list(shape)} (unshifted: batch() shifts them)."
            )
        as_tensor = getattr(self.backend, "as_tensor", None)
        to_numpy = getattr(self.backend, "to_numpy", None)
        if as_tensor is None or to_numpy is None:
            raise HpCpError(
                f"backend {self.backend_name!r} has no as_tensor / to_numpy op, so "
                "handle.batch cannot build the batch; shard the tensors with handle.shard "
                "(docs/writing-a-backend.md lists the optional ops)."
            )
        if cu_seqlens is not None:
            cu_seqlens = np.asarray(
                cu_seqlens
                if isinstance(cu_seqlens, list | tuple | np.ndarray)
                else to_numpy(cu_seqlens)
            )
            if shape[0] != 1:
                raise HpCpError(
                    f"packed input (cu_seqlens) needs batch size 1, got {shape[0]}; pack the "
                    "documents of the batch into one row, input_ids [1, S]."
                )
        plan = plan_batch(shape[1], self.cp_size, self.config.layout, cu_seqlens)
        if plan.packed or plan.padding.pad_rows:
            self.use_cp_path()
        host_labels = to_numpy(labels)
        shifted = plan.shifted_labels(host_labels, ignore_index)
        n_tokens = np.asarray(np.count_nonzero(shifted != ignore_index), dtype=np.int64)
        positions = as_tensor(plan.positions[None, :], input_ids)
        digest = batch_digest(to_numpy(input_ids), host_labels, plan.cu_seqlens)
        local_ids = self.shard(input_ids, 1, pad_value=0)
        self.sequence.record_batch(plan.rows, plan.padded_rows, digest)
        if plan.cu_seqlens is not None:  # for models handed per-row document ids only
            self.sequence.record_documents(plan.cu_seqlens)
        batch = CPBatch(
            input_ids=local_ids,
            position_ids=self.shard(positions, 1),
            labels=self.shard(as_tensor(shifted, labels), 1),
            n_tokens=as_tensor(n_tokens, labels),
            cu_seqlens=None if plan.cu_seqlens is None else as_tensor(plan.cu_seqlens, None),
            plan=plan,
            sequence=self.sequence,
            digest=digest,
        )
        self._mark(batch.input_ids, batch.position_ids, batch.labels, batch.cu_seqlens)
        return batch

    def unshard(self, tensor: Any, seq_dim: int = 1, rows: int | None = None) -> Any:
        """The full sequence from every rank's local rows (all-gather, then original order).

        ``rows``: keep only the first ``rows`` rows (drop what ``shard(..., pad_value=...)``
        appended).
        """
        local = self.backend.shape(tensor)[seq_dim]
        layout = self.layout(local * self.cp_size)
        gathered = self.group.all_gather_dim(tensor, seq_dim)  # rank-major
        order = np.concatenate([layout.rank_rows(k) for k in range(self.cp_size)])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        if rows is not None:
            inverse = inverse[: int(rows)]
        return self.backend.take(gathered, inverse, seq_dim)

    def stats(self) -> dict[str, Any]:
        """This rank's traffic (the group's ``stats()``, in the one schema of
        :mod:`hp_cp_core.stats`: ``bytes_sent``, ``bytes_recv``, ``collectives``) with the
        backend, CP rank and size, layout, layer count and plan-cache counters."""
        out = {
            "backend": self.backend_name,
            "cp_rank": self.cp_rank,
            "cp_size": self.cp_size,
            "layout": self.config.layout,
            "layers": len(self.layers),
            "plan_cache": self.cache.stats(),
            "compressed_slot_exchange": slot_exchange_kind(self.group),
        }
        out.update(self.group.stats())
        return out


def enable_cp(
    module: Any,
    mesh: Any,
    config: CPConfig | None = None,
    backend: str | None = None,
    *,
    plugins: PluginHost | None = None,
) -> CPHandle:
    """Run ``module`` (one attention layer or a whole model) with context parallelism.

    Args:
        module: an attention layer, or a model whose attention layers the backend finds.
        mesh: the framework's CP mesh: a torch ``DeviceMesh`` (1-D or ``mesh["cp"]``) or
            ``ProcessGroup``; a MindSpore / HyperParallel mesh or group name.
        config: :class:`CPConfig` options (layout, kernel, ...).
        backend: pick a backend by name when several could claim the module.
        plugins: an explicit :class:`~hp_cp_core.plugins.PluginHost` (tests); default: the
            process-wide one, discovered from entry points.

    Returns:
        A :class:`CPHandle`; ``disable_cp(handle)`` undoes exactly this call.

    Raises:
        BackendNotFoundError, BackendConflictError, BackendLoadError: no / several / a broken
            backend for the module.
        HpCpError: the module already runs under CP, the mesh is unusable, or the backend's
            API version is one this core cannot run (:mod:`hp_cp_core.versions`).
    """
    config = config if config is not None else CPConfig()
    if not isinstance(config, CPConfig):
        raise HpCpError(
            f"config must be a CPConfig, got {type(config).__name__}; build one with "
            "CPConfig(layout=..., attention_kernel=...)."
        )
    host = plugins if plugins is not None else get_plugin_host()
    name, be = host.choose_backend(module, backend)
    version = host.backend_api(name)
    check_api_usable(version, name)  # before the backend finds layers or makes its group
    layers = be.find_layers(module)
    if not layers:
        raise BackendNotFoundError(
            f"backend {name!r} accepted a `{type(module).__name__}` but found no attention layer "
            "in it to run under CP."
        )
    for layer in [module, *layers]:
        prev = getattr(layer, _MARK, None)
        if prev is not None and prev.active:
            raise HpCpError(
                f"`{type(layer).__name__}` already runs under CP (enabled with mesh "
                f"{prev.mesh!r}); call disable_cp(handle) on the first handle before enabling "
                "it again."
            )
    group = check_group_api(be.group(mesh), version, name, module)
    check_group(group, mesh, name)
    cache = PlanCache(config.plan_cache_size)
    handle = CPHandle(module, mesh, name, be, group, config, cache=cache)
    hooks = host.hooks
    specs = [(layer, check_layer_spec(hooks.layer_spec(layer), layer)) for layer in layers]
    handle.sharing = plan_sharing([spec for _, spec in specs])  # HpCpError before installing
    prepare = getattr(be, "prepare_module", None)  # optional: what a model needs beyond layers
    if prepare is not None:
        prepare(module, layers, handle)  # may raise (nothing installed yet); undo: on_disable
    for index, (layer, spec) in enumerate(specs):
        cp_forward = CPForward(
            layer,
            hooks,
            be,
            group,
            spec,
            config,
            handle.cache,
            handle.agreements,
            index,
            sequence=handle.sequence,
            roles=handle.sharing.roles(index),
            records=handle.records,
        )
        handle._tokens.append((layer, be.install(layer, cp_forward, group)))
        handle.layers.append((layer, spec))
        if group.size == 1 and config.single_rank_bypass:
            handle._kept_forwards.append(cp_forward)
    for obj in {id(o): o for o in [module, *layers]}.values():
        _set_mark(obj, handle)
    return handle


def disable_cp(handle: CPHandle) -> None:
    """Restore every forward ``enable_cp`` replaced; a second call does nothing."""
    if not handle.active:
        return
    for layer, token in reversed(handle._tokens):
        handle.backend.uninstall(layer, token)
    handle._tokens.clear()
    handle._kept_forwards.clear()
    while handle._cleanups:
        handle._cleanups.pop()()
    handle.records.clear()
    for obj in {id(o): o for o in [handle.module, *(lay for lay, _ in handle.layers)]}.values():
        _set_mark(obj, None)
    handle.active = False


def cp_state_not_copyable(module_type: str) -> HpCpError:
    """The error for pickling, ``torch.save``-ing or deep-copying a module under CP.

    Its forward is bound to this process's CP group, which cannot travel to another process
    or be duplicated; the parameters themselves are untouched by CP.
    """
    return HpCpError(
        f"cannot pickle or copy a `{module_type}` while it runs under CP: its forward "
        "is bound to this process's CP group. Save or copy `module.state_dict()` instead (CP "
        "leaves it unchanged) and load it into a fresh module, or call disable_cp(handle) "
        "first and enable_cp again afterwards (on the copy too)."
    )


def _set_mark(obj: Any, handle: CPHandle | None) -> None:
    try:
        if handle is None:
            if _MARK in getattr(obj, "__dict__", {}):
                object.__delattr__(obj, _MARK)
        else:
            object.__setattr__(obj, _MARK, handle)
    except (AttributeError, TypeError):  # objects without a __dict__ cannot be marked
        pass
