"""The machinery that runs a model adapter's hooks under CP (the spec's ``PluginManager``).

:class:`LayerRunner` drives one layer's :class:`~hp_cp_torch.model.spec.ModelAdapter` for the
torch plugin's stage hooks; no model overrides it. One forward: ``read_inputs``, the checks and
one agreement on every rank, ``project``, the core's exchanges (``compress``), the picks
(``index_scores``), the attention, ``output``, the indexer loss, ``finish``.
:func:`agree_values` is "inspect, then agree" once. The runner's services for model files:
:func:`model_handle` (what ``prepare_model`` reads of the handle), :class:`RowExchange` (a
side tensor's rows by a plan: V4.1's Engram hash), :func:`watch_model_argument`.

Note [Model values per forward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A model may hand its layers a value from outside their call: Megatron gives position_ids to
the GPTModel, never to the layers, and its adapter takes them from a forward pre-hook. A layer
may run again after a later forward of the model began: activation recomputation re-runs each
layer of a forward in its backward, and between the two another forward may run (an
evaluation forward, the next micro-batch). So such a value is kept per forward, by hp_cp's
record of the forward (Note [Records per forward] in :mod:`hp_cp_core.records`): the model
names the :class:`~hp_cp_torch.model.spec.LayerInputs` fields in ``traits.per_forward``;
an original call files them under its forward's record (per layer), a recomputed call (hp_cp's
scope finds its forward's record again: Note [Finding a recomputed forward's record]) gets
back what its forward filed, whatever ``read_inputs`` read now. The values live as long as the
forward's record, so as long as its graph::

    fwd A (pos A) ──> record A: pos A          fwd B (pos B) ──> record B: pos B
    bwd A: recompute layer k ──> record A ──> pos A, checked against A's plan
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hp_cp_core import CPContext, CPForward, HpCpError, LayerSpec, stage1_compress_with_halo
from hp_cp_core.api import cp_state_not_copyable
from hp_cp_core.columns import PlanColumns
from hp_cp_core.indexer_loss import indexer_loss_weight
from hp_cp_core.indices import lookback_index
from hp_cp_torch.attention import run_sparse_attention, select_topk_chunked
from hp_cp_torch.distributed.forward_scope import tensors_in
from hp_cp_torch.kernels.picked import HeadLayout
from hp_cp_torch.kernels.precision import uses_model_precision
from hp_cp_torch.kernels.registry import kernel_named
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.model.indexer_loss import attach_indexer_loss, indexer_loss_share, student_mismatch
from hp_cp_torch.model.spec import (
    RECORDED,
    ForwardState,
    LayerInputs,
    ModelAdapter,
    ModelHandle,
    PlanView,
)
from hp_cp_torch.model.validation import TensorChecks, rows_hint

__all__ = [
    "LayerRunner",
    "RowExchange",
    "RowPlan",
    "agree_values",
    "check_model_group",
    "model_argument",
    "model_handle",
    "runner_of",
    "watch_model_argument",
]

MODEL_ARGUMENT_ATTR = "_hp_cp_model_arguments"
"""Where a layer finds the :class:`_ModelArgument` values :func:`watch_model_argument` hands it."""

LOSS_CHUNK_ELEMENTS = 1 << 24
"""Most elements one query chunk of a model's own indexer loss holds (``(heads + indexer
heads) x batch x rows x slots``: the teacher's logits and the indexer's per-head scores)."""


def runner_of(adapter: Any) -> LayerRunner | None:
    """The runner of ``adapter`` (one per adapter, so per installed layer), or ``None``."""
    if adapter is not None and "_hp_cp_runner" not in adapter.__dict__:
        adapter.__dict__["_hp_cp_runner"] = LayerRunner(adapter)
    return None if adapter is None else adapter.__dict__["_hp_cp_runner"]


def agree_values(
    cp_forward: Any,
    check: Any,
    flags: list[tuple[Any, str]],
    across: bool,
    device: Any,
    extra: dict[str, Any] | None = None,
) -> CPContext:
    """Agree on ``check`` (``cp_forward.inspect``'s) and the value checks ``flags`` (``(flag,
    message)``, ``True`` fails; one entry of the agreement's gather ``across`` ranks, else
    read here on ``device``): an ``HpCpError`` on every rank when a rank's check failed."""
    if across:
        code = _first_failed([bad for bad, _ in flags], device) if check.ok else 0
        check.deferred = [(code, tuple(message for _, message in flags) if check.ok else ())]
    elif flags and check.ok:
        read = torch.stack([torch.as_tensor(bad, device=device).reshape(()) for bad, _ in flags])
        for bad, (_, message) in zip(read.cpu().tolist(), flags):
            if bad:
                check.fail(message)
    return cp_forward.agree(check, extra)


def check_model_group(adapter: ModelAdapter, handle: Any) -> None:
    """Refuse, when ``enable_cp`` installs the layer, a model whose own context-parallel
    group (``traits.model_group``) is not ``handle``'s: its data loading, gradient reduction
    and loss scales would be those of other ranks."""
    path = adapter.traits.model_group
    if path is None:
        return
    group = functools.reduce(lambda o, a: getattr(o, a, None), path.split("."), adapter.module)
    ranks = sorted(
        int(r)
        for r in ([dist.get_rank()] if group is None else dist.get_process_group_ranks(group))
    )
    want = sorted(int(r) for r in handle.group.global_ranks)
    if ranks != want:
        raise HpCpError(
            f"{adapter.layer_name()} under CP: the model's own context-parallel group "
            f"({path}: global ranks {ranks}, context_parallel_size={len(ranks)}) is not "
            f"hp_cp's group (global ranks {want}). Build the model with "
            f"context_parallel_size={len(want)} and pass its context-parallel group to "
            "enable_cp: hp_cp then owns the attention, and the model's data loading, gradient "
            "reduction and loss scales stay those of its own CP."
        )


class _ModelArgument:
    """One argument of a model-level module's forward while that forward runs (``None``
    outside one)."""

    def __init__(self, name: str, index: int) -> None:
        self.name, self.index, self.latest = name, index, None

    def hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        given = args[self.index : self.index + 1] or (None,)
        self.latest = kwargs[self.name] if self.name in kwargs else given[0]

    def done(self, *_: Any) -> None:
        self.latest = None  # always called: a layer run outside the forward takes none

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise cp_state_not_copyable("a layer hp_cp runs")


def watch_model_argument(
    model: Any, owner: type, name: str, index: int, layers: list[Any], handle: Any
) -> None:
    """Hand ``layers`` the argument ``name`` (positional ``index``) of the forward of each
    ``owner`` module of ``model`` while it runs (:func:`model_argument` reads it, say in
    ``read_inputs``); name the field it fills in ``traits.per_forward`` so that a recomputed
    call gets its own forward's (Note [Model values per forward]). Undone by ``disable_cp``."""
    arg = _ModelArgument(name, index)
    for mod in model.modules():
        if isinstance(mod, owner):
            handle.on_disable(mod.register_forward_pre_hook(arg.hook, with_kwargs=True).remove)
            handle.on_disable(mod.register_forward_hook(arg.done, always_call=True).remove)
    for layer in layers:
        layer.__dict__.setdefault(MODEL_ARGUMENT_ATTR, {})[name] = arg
    handle.on_disable(lambda: [layer.__dict__.pop(MODEL_ARGUMENT_ATTR, None) for layer in layers])


def model_argument(layer: Any, name: str) -> Any:
    """The running model forward's argument ``name`` that :func:`watch_model_argument` hands
    ``layer``, or ``None`` (outside such a forward, or not watched)."""
    arg = layer.__dict__.get(MODEL_ARGUMENT_ATTR, {}).get(name)
    return None if arg is None else arg.latest


def model_handle(handle: Any) -> ModelHandle:
    """The :class:`~hp_cp_torch.model.spec.ModelHandle` of ``handle`` (what an adapter's
    ``prepare_model`` is handed)."""
    return ModelHandle(
        cp_size=int(handle.group.size),
        rank=int(handle.group.rank),
        config=handle.config,
        on_disable=handle.on_disable,
        documents=functools.partial(_documents, handle),
        row_exchange=functools.partial(RowExchange, handle),
        _handle=handle,
    )


def _documents(handle: Any, rows: int) -> np.ndarray | None:
    """The document boundaries of the running forward's batch (Note [Records per forward]
    in :mod:`hp_cp_core.records`) for ``rows`` global rows, or ``None``."""
    current = handle.records.current
    return (handle.sequence if current is None else current.sequence).documents(int(rows))


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One forward's plan of a :class:`RowExchange` (:meth:`RowExchange.agree`), agreed on
    every rank.

    Attributes:
        view: the :class:`~hp_cp_torch.model.spec.PlanView` of this rank's rows.
        lookback: ``[L, W]`` int64: per local row ``t``, the rows of :meth:`exchange`'s
            frame holding rows ``t, t-1, .., t-W+1``; ``-1`` where that row lies before
            ``t``'s document (or the sequence).
    """

    view: PlanView
    lookback: np.ndarray
    _plan: Any = dataclasses.field(repr=False, compare=False)
    _group: Any = dataclasses.field(repr=False, compare=False)

    def exchange(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows this rank reads, ``[B, E, ...]``, of this rank's rows ``[B, L, ...]``
        (batch-major, any dtype): the halo from the ranks before it, then its own, in the
        frame of a layer's window KV (``AttentionRequest.ori_ext``); one exchange on every
        rank, with autograd, ordered as a layer's (Note [Backward order] in
        :mod:`hp_cp_core.collectives`)."""
        group, window = self._group, self._plan.window
        if rows_hint(rows, 1) != len(self.view.rows):
            raise HpCpError(
                f"RowPlan.exchange: got rows {list(getattr(rows, 'shape', []))}; expected "
                f"[B, {len(self.view.rows)}, ...], the rows its agree() was given."
            )
        # as a layer's exchanges: in the graph on every rank alike (Note [Backward order])
        ordered = torch.is_grad_enabled() and rows.is_floating_point()
        token = group.begin_order(rows) if ordered else None
        (ext,), token = group.exchange_rows([(rows.transpose(0, 1).contiguous(), window)], token)
        if window.ext_from_recv is not None:
            ext = ext[torch.as_tensor(window.ext_from_recv, device=ext.device)]
        ext = ext.transpose(0, 1)  # [B, E, ...]
        return group.end_order(ext, token) if ordered else ext


class RowExchange:
    """Other ranks' rows of a side tensor of the model's (not a layer's K/V: V4.1's Engram
    token ids), for a model-level module whose row ``t`` reads rows ``t - window + 1 .. t``
    of its document: by a plan of the core's (a layer of ``window`` rows, no slots), agreed
    on every rank, through the collectives of a layer's halo (``handle.row_exchange(window,
    name)`` in ``prepare_model``; built once, used every forward)::

        plan = exchange.agree(rows, cu_seqlens=RECORDED, flags=[(bad, message)])
        ext = plan.exchange(side)  # [B, E, ...]; plan.lookback [L, W] indexes its rows

    Args:
        handle: the ``enable_cp`` handle.
        window: the rows back each row reads, itself included (>= 1).
        name: whose exchange, as its errors name it (``"<name> under CP: ..."``).
    """

    def __init__(self, handle: Any, window: int, name: str) -> None:
        if int(window) < 1:
            raise HpCpError(f"{name} under CP: row_exchange(window={window}); expected >= 1.")
        self.name, self.window, self.handle = name, int(window), handle
        spec = LayerSpec(compress_ratio=0, window_size=self.window)
        self.cp_forward = CPForward(
            None, None, handle.backend, handle.group, spec, handle.config, handle.cache,
            None, records=handle.records,
        )  # fmt: skip

    def agree(
        self,
        rows: Any,
        *,
        cu_seqlens: Any = None,
        problems: Sequence[str] = (),
        flags: Sequence[tuple[Any, str]] = (),
    ) -> RowPlan:
        """This forward's :class:`RowPlan` for this rank's rows ``[B, L, ...]`` (batch-major;
        only their shape is read), after one agreement: every rank raises together what
        any rank found (``problems``, messages; ``flags``, ``(flag, message)`` with a 0-dim
        bool tensor or a bool, ``True`` failing, read in the agreement's gather).

        Args:
            rows: this rank's rows (or a tensor of their shape).
            cu_seqlens: the global document boundaries ``[0, ..., S]``, ``RECORDED`` (those
                ``handle.batch`` / ``cp_nemo_batch`` recorded for this forward), or ``None``.
            problems: what the caller's own checks found, each a message with its fix.
            flags: the caller's checks of tensor values.
        """
        where, group, cpf = f"{self.name} under CP", self.handle.group, self.cp_forward
        found = [f"{where}: {p}" for p in problems]
        if not isinstance(rows, torch.Tensor) or rows.dim() < 2:
            got = list(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            found.append(f"{where}: got rows {got}; expected this rank's rows [B, L, ...].")
        n_local = rows_hint(rows, 1)
        if cu_seqlens is RECORDED:
            cu_seqlens = cpf.sequence.documents(n_local * group.size)  # this forward's
            if cu_seqlens is None:
                found.append(
                    f"{where}: packed input needs the document boundaries of this forward, "
                    "which handle.batch(..., cu_seqlens=) or cp_nemo_batch record."
                )
        flags = [] if found else flags
        check = cpf.inspect(n_local, cu_seqlens, problems=found)
        across = group.size > 1 and self.handle.config.check_inputs_across_ranks
        device = getattr(rows, "device", None)
        messages = [(bad, f"{where}: {message}") for bad, message in flags]
        call = agree_values(cpf, check, messages, across, device)
        plan = call.plan
        real = cpf.sequence_rows(n_local)
        view = PlanView.of(plan, real, call.cu_seqlens)
        look = lookback_index(plan.window_start, plan.window_len, self.window)
        return RowPlan(view, look, plan, group)

    def __call__(self, rows: torch.Tensor, *, cu_seqlens: Any = None) -> tuple[RowPlan, Any]:
        """``(plan, plan.exchange(rows))``: :meth:`agree` and the exchange of ``rows``."""
        plan = self.agree(rows, cu_seqlens=cu_seqlens)
        return plan, plan.exchange(rows)


def _first_failed(flags: list[Any], device: Any) -> Any:
    """``k`` (a 0-dim int64 tensor on ``device``, not read): the number of the first failed
    flag, 1-based; 0 when none failed (or there are none)."""
    if not flags:
        return 0
    failed = torch.stack([torch.as_tensor(f, device=device).reshape(()).bool() for f in flags])
    number = torch.arange(1, len(flags) + 1, device=device)
    return torch.where(failed, number, len(flags) + 1).min() % (len(flags) + 1)


class LayerRunner:
    """hp_cp's machinery for one layer, calling its ``adapter``'s hooks."""

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.module = adapter.module
        self.traits = adapter.traits
        self._v03 = getattr(type(adapter), "_v03", {})
        self._student_checked = False

    # -------------------------------------------------------------- the core's stage hooks
    def layer_spec(self) -> Any:
        return self.adapter.layer_spec()

    def extract_ori_kv(self, key: torch.Tensor) -> torch.Tensor:
        return key  # the window KV rows [L, B, D] make_forward passed

    def compress_main(self, x: Any, halo_x: Any, call: CPContext) -> torch.Tensor:
        state = call.extra["state"]
        if self.traits.rows_are_slots:  # the slots a rank owns are its rows, ascending
            return state.projection.kv.transpose(0, 1)
        compress = self._rows("compress(rows, start, state)", self.adapter.compress, call)
        return stage1_compress_with_halo(compress, x, halo_x, call)

    def compress_indexer(self, x: Any, halo_x: Any, call: CPContext) -> torch.Tensor:
        state, hook = call.extra["state"], "compress_index_keys(rows, start, state)"
        if self.traits.rows_are_slots:
            keys = state.projection.index_keys
            want = (*state.hidden.shape[:2], None)
            self.expect("project(state).index_keys", keys, want, "[B, L, D_I]")
            return keys.transpose(0, 1)
        grad = self.traits.indexer_grad
        if grad != "full":
            x, halo_x = x.detach(), None if halo_x is None else halo_x.detach()
        keys = self._rows(hook, self.adapter.compress_index_keys, call)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grad != "none"):
            return stage1_compress_with_halo(keys, x, halo_x, call)

    def run_attention(self, query: Any, ori_ext: Any, x: Any, qr: Any, call: CPContext) -> Any:
        """The picks, the attention, ``output``, the indexer loss, on ``state.projection.query``
        (``query``, its view, is for a plugin overriding the stage; ``qr`` is unused)."""
        state = call.extra["state"]
        for name, t in (("slots", call.slots), ("keys", call.keys)):
            setattr(state, name, None if t is None else t.transpose(0, 1))  # [B, N, D]
        state.candidates = call.reused.get("candidates")
        params = self.adapter.attention_params()
        selected = self.selection(state, call, params.kind == "own")
        q, kv_ext = state.projection.query, ori_ext.transpose(0, 1)  # [B, L, H, D], [B, E, D]
        args = (q, kv_ext, state.slots, call.plan, selected, params.sink, params.scale)
        request = AttentionRequest(*args, call.config.query_chunk)
        o = self.attend(request, state, params, call.config)
        self.expect("the attention", o, (*state.hidden.shape[:2], None, None), "[B, L, H, D]")
        return self.indexer_loss(self.adapter.output(o, state), state, call, request, params)

    def make_forward(self, cp_forward: Any, group: Any) -> Callable[..., Any]:
        """The layer's forward under CP: ``read_inputs``, :meth:`begin`, ``project``, the
        core's CP forward (this runner its stage object: Note [A direct runtime path] in
        :mod:`hp_cp_core.plugins`), ``finish``."""
        runner, adapter = self, self.adapter

        def forward(*args: Any, **kwargs: Any) -> Any:
            inputs = adapter.read_inputs(*args, **kwargs)
            runner.per_forward(cp_forward, inputs)
            hidden = inputs.hidden
            seq_major = runner.traits.sequence_dim == 0 and getattr(hidden, "ndim", 0) == 3
            if seq_major:  # the hooks see batch-major rows
                inputs.hidden = hidden.transpose(0, 1)
            call, state = runner.begin(cp_forward, group, inputs)
            state.projection = proj = adapter.project(state)
            rows = tuple(state.hidden.shape[:2])
            runner.expect("project(state).kv", proj.kv, (*rows, None), "[B, L, D]")
            if proj.query is not None:
                query = (*rows, None, None)
                runner.expect("project(state).query", proj.query, query, "[B, L, H, D]")
            out = cp_forward(
                None if proj.query is None else proj.query.transpose(0, 1),
                proj.kv.transpose(0, 1),
                hidden if seq_major else state.hidden.transpose(0, 1),  # the core's [L, B, C]
                call=call,
                local_work=proj.local_work,
                stages=runner,
                state=state,
            )
            return adapter.finish(out.transpose(0, 1) if seq_major else out, state)

        own = inspect.signature(adapter.read_inputs)  # the layer's own arguments
        forward.__signature__ = own.replace(return_annotation=inspect.Signature.empty)
        return forward

    # -------------------------------------------------------------- one forward's steps
    def per_forward(self, cp_forward: Any, inputs: LayerInputs) -> None:
        """File ``traits.per_forward``'s fields of ``inputs`` under this forward's record, or
        in a recomputed call put back what its forward filed (Note [Model values per
        forward])."""
        records = getattr(cp_forward, "records", None)
        record = None if records is None else records.current
        if not self.traits.per_forward or record is None:
            return
        index = getattr(cp_forward, "index", 0)
        for name in self.traits.per_forward:
            if records.recomputing:
                setattr(inputs, name, record.filed.get((index, name)))
            else:
                record.filed[index, name] = getattr(inputs, name)

    def begin(
        self, cp_forward: Any, group: Any, inputs: LayerInputs
    ) -> tuple[CPContext, ForwardState]:
        """The recorded values (``RECORDED`` boundaries, ``real_rows``), the agreement
        (:meth:`agree_inputs`), then this forward's state (the positions given or the plan's)."""
        sequence, x = cp_forward.sequence, inputs.hidden
        if inputs.cu_seqlens is RECORDED:
            rows = rows_hint(x, -2) * group.size
            inputs.cu_seqlens = None if sequence is None else sequence.documents(rows)
        pad = None if sequence is None else sequence.padding
        inputs.real_rows = pad.rows if pad is not None and pad.pad_rows else None
        call, mask = self.agree_inputs(cp_forward, group, inputs)
        xb = x[None] if x.dim() == 2 else x  # [B, L, hidden]
        positions = inputs.position_ids
        if positions is None:
            positions = torch.as_tensor(call.positions, device=x.device)
        positions = positions.reshape(-1, xb.shape[1]).expand(xb.shape[0], -1)
        state = self.traits.state_class(inputs, xb, positions, loss_mask=mask)
        state.plan = call.plan
        state.view = PlanView.of(call.plan, inputs.real_rows, call.cu_seqlens)
        return call, state

    def agree_inputs(
        self, cp_forward: Any, group: Any, inputs: LayerInputs
    ) -> tuple[CPContext, torch.Tensor | None]:
        """Check one forward's inputs on every rank, before any exchange, and agree on them:
        ``check_inputs``, the kernel, the plan, ``value_checks`` (in the agreement's gather,
        or read here when the agreement is reused or local; skipped by a later layer of the
        same forward handed the same tensors) and the indexer loss's row count. Returns the
        context and the ``[B, L]`` rows that count in the indexer loss (``None``: all)."""
        a, x = self.adapter, inputs.hidden
        checks = TensorChecks(getattr(group, "device", None), f"{a.layer_name()} under CP")
        a.check_inputs(inputs, checks)
        kind = a.attention_params().kind
        if isinstance(x, torch.Tensor) and kind != "own":
            checks.kernel(cp_forward.config.attention_kernel, x.device)
        loss = self.indexer_params(cp_forward.spec)
        if kind == "own" and loss is not None and loss.loss_coeff is not None:
            checks.fail(
                "attention_params(kind='own') with indexer_params().loss_coeff set: hp_cp's "
                "indexer loss needs the picks and the attention's weights, which a layer that "
                "runs its own attention keeps to itself; set loss_coeff=None and attach the "
                "model's own loss in finish(), or declare kind='shared_kv', 'grouped' or "
                "'latent'."
            )
        if kind in ("grouped", "latent") and cp_forward.spec.window_size:
            checks.fail(
                f"attention_params(kind={kind!r}) attends to the indexer's picks only, but "
                f"layer_spec() has window_size={cp_forward.spec.window_size}; a layer with a "
                "window has one KV head shared by keys and values (kind='shared_kv') or runs "
                "its own attention (kind='own')."
            )
        cu = checks.host_cu_seqlens(inputs.cu_seqlens)
        check = cp_forward.inspect(
            rows_hint(x, -2), cu, problems=checks.problems, signature=checks.signature
        )
        memo, index = getattr(cp_forward, "memo", None), getattr(cp_forward, "index", 0)
        params = self.indexer_params(cp_forward.spec)
        with_loss = params is not None and params.loss_coeff is not None
        counted = with_loss and inputs.loss_mask is not None  # a per-rank count to sum
        reuse = memo is not None and cp_forward.reuses_agreement(counted)
        across = not reuse and group.size > 1 and cp_forward.config.check_inputs_across_ranks
        if not check.ok:
            return agree_values(cp_forward, check, [], across, None), None
        xb = x[None] if x.dim() == 2 else x  # [B, L, hidden]
        mask, extra = _loss_rows(cp_forward, xb, inputs.loss_mask, with_loss)
        seen = self.read_objects(inputs)
        # a group of one never reuses an agreement (there is none); a later layer of the same
        # forward (a higher index) given the very objects its first layer checked skips too
        same_forward = group.size == 1 and memo is not None and index > memo.checked_index
        replay = getattr(cp_forward, "replayed", lambda: None)()  # a recomputation: as before
        if replay is not None:
            skip = replay.checks_skipped
        else:
            skip = seen is not None and (reuse or same_forward) and memo.checked == seen
        if skip:
            if replay is None:
                cp_forward.skip_checks()
            return cp_forward.agree(check, extra), mask  # checked by this forward's first layer
        view = PlanView.of(check.plan, inputs.real_rows, cu)
        flags = [(bad, f"{checks.where}: {m}") for bad, m in a.value_checks(inputs, view)]
        if memo is not None and replay is None:
            memo.checked = None
        call = agree_values(cp_forward, check, flags, across, x.device, extra)
        if memo is not None and replay is None:  # reached only when every flag was clear
            memo.checked, memo.checked_index = seen, index
        return call, mask

    def read_objects(self, inputs: LayerInputs) -> tuple[Any, ...] | None:
        """What ``value_checks`` may read: the identities of the tensor fields of ``inputs``
        but ``hidden``, and the rows (a 0.3 adapter's ``checked_objects`` where it has one)."""
        if "checked_objects" in self._v03:
            return self._v03["checked_objects"](self.adapter, inputs)
        values = (getattr(inputs, f.name) for f in fields(inputs) if f.name != "hidden")
        return (*(id(v) for v in values if torch.is_tensor(v)), rows_hint(inputs.hidden, -2))

    def indexer_params(self, spec: Any) -> Any:
        """The adapter's ``indexer_params()`` on a layer with an indexer, else ``None``."""
        return self.adapter.indexer_params() if spec.has_indexer else None

    def selection(self, state: ForwardState, call: CPContext, own: bool) -> Any:
        """The picks this forward attends to: those of the layer it shares them with
        (``call.reused``, Note [Layers that share their indexer]), else :meth:`select`'s
        (none for the model's ``own`` attention); published with the candidates for the
        layers that reuse them, kept as ``state.selected``."""
        selected = call.reused.get("selection")
        if selected is None and state.keys is not None and not own:
            if state.index_queries is None:
                state.index_queries = self.adapter.index_queries(state)
            selected = self.select(state, call)
        if selected is not None:
            selected = selected.to(state.hidden.device)
        publishes = (lambda _: False) if call.roles is None else call.roles.publishes
        if selected is not None and publishes("selection"):
            call.outputs["selection"] = selected
        if publishes("candidates"):
            call.outputs["candidates"] = state.candidates
        state.selected = selected
        return selected

    def select(self, state: ForwardState, call: CPContext) -> torch.Tensor:
        """The indexer's top-k over each local query's visible slots (global slot ids,
        ``-1`` = none), without autograd (the loss's student is recomputed)."""
        a, keys, params = self.adapter, state.keys, self.indexer_params(call.spec)
        if params is None:
            raise HpCpError(
                f"{a.layer_name()} under CP: layer_spec() has an indexer but indexer_params() "
                "returns None; return IndexerParams(topk=..., heads=...)."
            )
        own_candidates = type(a).block_candidates is not ModelAdapter.block_candidates
        hook = functools.partial(a.block_candidates, state) if own_candidates else None

        def scores(lo: int, hi: int, s0: int, s1: int) -> torch.Tensor:
            got = a.index_scores(state, lo, hi, keys[:, s0:s1])
            want = (keys.shape[0], hi - lo, s1 - s0)
            return self.expect("index_scores(state, lo, hi, keys)", got, want, "[B, hi - lo, s]")

        with torch.no_grad():
            return select_topk_chunked(
                scores,
                call.plan,
                params.topk,
                call.config.query_chunk,
                batch=state.hidden.shape[0],
                score_heads=params.heads,
                one_process_row=self.traits.packed_topk_row,
                sequence_rows=call.sequence_rows,
                cu_seqlens=call.cu_seqlens,
                row_hook=hook,
                ascending=self.traits.ascending_picks,
            )

    def attend(self, request: AttentionRequest, state: Any, params: Any, config: Any) -> Any:
        """The attention ``[B, L, H, D]``: the model's own (``kind="own"``, or its op order for
        ``model_ops`` / ``attention_precision="model"``), else by ``params.kind``."""
        a, r = self.adapter, request
        if params.kind == "own" or uses_model_precision(config):
            o = a.attention(request, state)
            if o is not None:
                return o
            if params.kind == "own":
                raise HpCpError(
                    f"{a.layer_name()} under CP: attention_params() declares kind='own' but "
                    "attention(request, state) returned None; return the attention [B, L, H, D]."
                )
        if "attend" in self._v03:  # a 0.3 adapter's own kernel call
            return self._v03["attend"](a, request, state, config.attention_kernel)
        if params.kind in ("latent", "grouped"):
            return _with_heads(request, params, config.attention_kernel)
        args = (r.q, r.ori_ext, r.cmp_kv, r.plan, r.selected, r.sink, r.scale)
        return run_sparse_attention(
            *args, kernel=config.attention_kernel, query_chunk=r.query_chunk
        )

    def indexer_loss(
        self,
        out: torch.Tensor,
        state: ForwardState,
        call: CPContext,
        request: AttentionRequest,
        attention: Any = None,
    ) -> torch.Tensor:
        """This rank's share of the indexer loss attached to ``out`` (Note [Indexer loss
        under CP]); its global mean, the same on every rank, kept as ``module.indexer_loss``.
        ``attention``: the layer's ``AttentionParams`` (a latent layer's teacher is in the
        absorbed form, a grouped layer's per KV head)."""
        params, r = self.indexer_params(call.spec), request
        if params is None or params.loss_coeff is None or r.selected is None or state.keys is None:
            self.record_indexer_loss(None)
            return out
        if type(self.adapter).indexer_row_kl is not ModelAdapter.indexer_row_kl:
            share = self.model_indexer_loss(state, call)
            if params.loss_mean:
                share = share * indexer_loss_weight(call)
        else:
            student = self.adapter.indexer_loss_scores(state, state.keys, r.selected)
            self.check_student_once(state, student)
            args = (r.q, r.ori_ext, r.cmp_kv, r.selected, student, r.sink, r.scale)
            kind = getattr(attention, "kind", "shared_kv")
            latent = attention.latent if kind == "latent" else None
            kv_heads = attention.kv_heads if kind == "grouped" else None
            share = indexer_loss_share(
                call, *args, state.loss_mask, latent, kv_heads, mean=params.loss_mean
            )
        if params.loss_attach is not None:  # the model's own attach (and logging)
            return params.loss_attach(out, share * params.loss_coeff)
        self.record_indexer_loss(call.group.sum_detached(share))  # no host sync
        return attach_indexer_loss(out, share, params.loss_coeff)

    def model_indexer_loss(self, state: ForwardState, call: CPContext) -> torch.Tensor:
        """This rank's sum of the model's per-row KL (``indexer_row_kl``) over the rows
        that count (``state.loss_mask``), in query chunks of at most
        :data:`LOSS_CHUNK_ELEMENTS`; a chunk whose rows see no slot has none. Every rank's sum
        reaches its indexer queries and gathered keys (the keys' exchange runs its backward
        on every rank), whatever its rows."""
        a, plan, batch = self.adapter, call.plan, state.hidden.shape[0]
        grads = [t for t in tensors_in((state.index_queries, state.keys)) if t.requires_grad]
        total = sum((t.sum() for t in grads), torch.zeros((), device=state.hidden.device))
        total = total.float() * 0.0
        stop = plan.cmp_start + plan.cmp_count
        heads = state.projection.query.shape[2] if state.projection.query is not None else 1
        per_row = (heads + self.indexer_params(call.spec).heads) * int(stop.max(initial=0))
        rows = max(1, LOSS_CHUNK_ELEMENTS // max(1, per_row * batch))
        for lo, hi in PlanColumns(plan, 0).chunks(rows):
            if hi == lo or int(stop[lo:hi].max()) == 0:
                continue
            kl = a.indexer_row_kl(state, lo, hi)
            kl = self.expect("indexer_row_kl(state, lo, hi)", kl, (batch, hi - lo), "[B, l]")
            if state.loss_mask is not None:
                kl = kl * state.loss_mask[:, lo:hi].to(kl.dtype)
            total = total + kl.sum()
        return total

    def record_indexer_loss(self, loss: torch.Tensor | None) -> None:
        """``module.indexer_loss = loss`` (``None`` only on a module that has the attribute;
        a 0.3 adapter's ``record_indexer_loss`` where it has one)."""
        if "record_indexer_loss" in self._v03:
            self._v03["record_indexer_loss"](self.adapter, loss)
        elif loss is not None or hasattr(self.module, "indexer_loss"):
            self.module.indexer_loss = loss

    def check_student_once(self, state: ForwardState, student: torch.Tensor) -> None:
        """Warn (once per layer) when the default ``indexer_loss_scores`` (DeepSeek's
        formula) scores otherwise than the model's ``index_scores``: its loss would train
        another score. A warning, not an error: a rank whose queries have no picks cannot
        compare, and an error on some ranks only would hang the rest."""
        a = self.adapter
        if self._student_checked or type(a).indexer_loss_scores is not (
            ModelAdapter.indexer_loss_scores
        ):
            return
        self._student_checked = True
        scores = functools.partial(a.index_scores, state)
        problem = student_mismatch(scores, state.keys, state.selected, student)
        if problem is not None:
            warnings.warn(f"{a.layer_name()} under CP: {problem}", stacklevel=2)

    def _rows(self, hook: str, fn: Callable[..., Any], call: CPContext) -> Callable[..., Any]:
        """``fn(rows [B, n, C], start, state)`` for the core's sequence-major rows ``[n, B,
        C]``, its slots checked to be ``[B, n // r, D]``."""
        r, state = call.spec.compress_ratio, call.extra["state"]

        def compress(rows: torch.Tensor, start: int) -> torch.Tensor:
            out = fn(rows.transpose(0, 1), start, state)
            self.expect(hook, out, (rows.shape[1], rows.shape[0] // r, None), "[B, n // r, D]")
            return out.transpose(0, 1)

        return compress

    def expect(self, hook: str, got: Any, want: tuple[Any, ...], layout: str) -> Any:
        """``got``, a tensor of shape ``want`` (``None``: any size), else an
        :class:`~hp_cp_core.HpCpError` naming the hook and the shape it must return."""
        shape = getattr(got, "shape", None)
        if shape is not None and len(shape) == len(want):
            if all(w is None or int(n) == w for n, w in zip(shape, want)):
                return got
        got_text = list(shape) if shape is not None else type(got).__name__
        want_text = ", ".join("*" if w is None else str(w) for w in want)
        raise HpCpError(
            f"{self.adapter.layer_name()} under CP: the hook {hook} returned {got_text}; "
            f"expected {layout} = [{want_text}] (docs/writing-a-model-adapter.md)."
        )


def _with_heads(request: AttentionRequest, params: Any, kernel_name: Any) -> torch.Tensor:
    """Grouped-query or latent attention: the request with its :class:`HeadLayout`, by the
    configured kernel where it runs that kind (``kinds``), else by ``banded``."""
    width = request.cmp_kv.shape[-1]
    if params.kind == "latent":
        lat = params.latent
        layout, up_proj = HeadLayout.mla(lat.nope, lat.rope, lat.value, lat.rank), lat.up_proj
    else:
        g, d_k = params.kv_heads, request.q.shape[-1]
        layout, up_proj = HeadLayout.grouped(g, d_k, (width - g * d_k) // g), None
    kernel = kernel_named(kernel_name)
    if params.kind not in getattr(kernel, "kinds", ("shared_kv",)):
        kernel = kernel_named("banded")
    return kernel(dataclasses.replace(request, head_layout=layout, up_proj=up_proj))


def _loss_rows(cp_forward: Any, xb: torch.Tensor, loss_mask: Any, with_loss: bool) -> Any:
    """``(mask [B, L] or None, extra)``: the local rows that count in the indexer loss and
    the agreement's count of them (``{}`` without a loss): a loss mask's rows are this
    rank's ``loss_rows``, summed in the agreement; else every real row counts and the
    total, batch x real rows, is known on every rank (``loss_rows_total``). The rows
    ``handle.shard(..., pad_value=)`` appended never count."""
    if not with_loss:
        return None, {}
    real = cp_forward.real_rows(xb.shape[1])
    real_t = None if real is None else torch.as_tensor(real, device=xb.device)
    if loss_mask is not None:
        keep = loss_mask.reshape(-1, xb.shape[1]) != 0
        keep = keep if real_t is None else keep & real_t
        mask = keep.expand(xb.shape[0], -1)
        return mask, {"loss_rows": int(mask.sum())}
    total = {"loss_rows_total": cp_forward.loss_rows_total(xb.shape[1], xb.shape[0])}
    if real_t is not None:
        return real_t.reshape(1, -1).expand(xb.shape[0], -1), total
    return None, total  # every row counts
