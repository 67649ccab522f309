"""The model-adapter contract: what a model supplies to run under CP, and the machinery it gets.

A model adapter is a subclass of :class:`ModelAdapter` registered under the entry-point group
``hp_cp.torch_models`` (:mod:`hp_cp_torch.model_registry`); ``hp_cp_core.enable_cp(model,
mesh)`` then finds every module of a claimed class, builds one adapter per layer at install
(kept on the layer until ``disable_cp``) and replaces the layer's forward.

The adapter supplies only model math, on the rank's *local* rows, batch-major:

======================  ====================================================================
method                  what the model computes
======================  ====================================================================
``layer_spec``          compress ratio, window, whether it has an indexer (once, at enable)
``read_inputs``         its forward's arguments -> :class:`LayerInputs`
``project``             queries ``[B, L, H, D]`` and the shared KV row ``[B, L, D]``
``compress``            compressed slots of one document's rows (the main compressor)
``compress_index_keys`` the indexer's compressed keys (CSA)
``index_queries``       what the indexer scores with (once per forward)
``index_scores``        scores of some local queries over some slots
``index_topk``          how many slots each query keeps
``sink`` / ``scale``    the attention's per-head sink logits and softmax scale
``output``              the attention result ``[B, L, H, D]`` -> the layer's output
``finish``              the layer's return value (default: the output)
``model_attention``     optional: the model's own attention op order, in its dtype
``problems``            optional: what CP cannot compute in this call (a cache, dropout...)
``value_checks``        optional: checks that read tensor values (positions against the plan)
``check_tensors``       optional: the input tensors' checks (default: ``x [B, L, hidden]``)
======================  ====================================================================

Everything else is machinery, here once: running the input checks and agreeing on them
across ranks (before any exchange; :meth:`ModelAdapter.agree_inputs`), the compressor's halo
and the slot exchange (the core), the indexer's selection over the visible slots (with the
one-process top-k row when the model's own ``torch.topk`` ties must be matched), the
attention kernel (:mod:`hp_cp_torch.kernels.registry`), the indexer loss, install and undo.
One forward's values travel in a typed :class:`ForwardState` (``call.extra["state"]``), not
in string-keyed dictionaries.

Rows, positions and documents: ``compress`` is called once per document segment that starts
on a block boundary, with ``start`` the document-relative position of its first row (so a
compressor that ropes slot ``j`` at ``start + j*r`` is exact); with packed input the positions
a layer sees restart at 0 per document. ``None`` from an optional method means "the model has
none" (no indexer loss, no own op order).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hp_cp_core import DeepSeekV4CPContext, HpCpError, LayerSpec, stage1_compress_with_halo
from hp_cp_torch.attention import run_sparse_attention, select_topk_chunked
from hp_cp_torch.indexer_loss import (
    attach_indexer_loss,
    indexer_loss_share,
    indexer_scores_at,
    student_mismatch,
)
from hp_cp_torch.kernels.registry import AttentionRequest
from hp_cp_torch.precision import uses_model_precision
from hp_cp_torch.validation import TensorChecks, check_reference_inputs, rows_hint

__all__ = ["ForwardState", "LayerInputs", "ModelAdapter", "Projection"]


@dataclass
class LayerInputs:
    """A layer forward's arguments, as :meth:`ModelAdapter.read_inputs` reads them.

    Attributes:
        hidden: the local rows ``[B, L, hidden]`` (padded) or ``[L, hidden]`` /
            ``[1, L, hidden]`` with ``cu_seqlens`` (packed).
        position_ids: the rows' positions (``[L]`` or ``[B, L]``; packed: restarting per
            document), or ``None`` to take the plan's.
        cu_seqlens: the global document boundaries ``[0, ..., S]`` (packed), else ``None``.
        loss_mask: rows that count in the indexer loss (``[L]`` or ``[B, L]``), or ``None``.
    """

    hidden: Any
    position_ids: Any = None
    cu_seqlens: Any = None
    loss_mask: Any = None


@dataclass
class Projection:
    """What :meth:`ModelAdapter.project` returns for the local rows.

    Attributes:
        query: ``[B, L, H, D]``, roped as the model ropes them.
        kv: the shared KV head ``[B, L, D]`` (keys and values are one row), roped.
        index_input: what :meth:`ModelAdapter.index_queries` needs beyond the state (e.g. the
            query's low-rank residual), or ``None``.
        local_work: work that needs no received row, run while the exchanges travel (Note
            [Overlapped exchanges] in :mod:`hp_cp_core.collectives`): the first callable
            during the halo exchange, the rest during the slot exchange. With it ``query``
            may be ``None`` here, set on ``state.projection`` by the work.
    """

    query: torch.Tensor | None
    kv: torch.Tensor
    index_input: Any = None
    local_work: tuple[Callable[[], None], ...] = ()


@dataclass
class ForwardState:
    """One layer's CP forward, from its forward to its stage hooks (``call.extra["state"]``).

    A model adds its own fields by subclassing this dataclass and naming the subclass in
    :attr:`ModelAdapter.state_class`.

    Attributes:
        inputs: the forward's :class:`LayerInputs`.
        hidden: the local rows, batch-major ``[B, L, hidden]``.
        positions: ``[B, L]`` positions of the local rows (packed: per document).
        projection: the layer's :class:`Projection` (set before the exchanges).
        loss_mask: ``[B, L]`` bool rows that count in the indexer loss, or ``None`` (all).
        index_queries: what :meth:`ModelAdapter.index_queries` returned.
        selected: the picks this forward attended to (``[B, L, k]`` global slot ids), or
            ``None`` (no indexer).
    """

    inputs: LayerInputs
    hidden: torch.Tensor
    positions: torch.Tensor
    projection: Projection | None = None
    loss_mask: torch.Tensor | None = None
    index_queries: Any = None
    selected: Any = None


def _seq_major(fn: Callable[..., torch.Tensor], state: Any) -> Callable[..., torch.Tensor]:
    """``fn(rows [B, n, C], start)`` (or ``fn(rows, start, state)``: a compressor that reads
    the forward's state) for the core's sequence-major rows ``[n, B, C]``."""
    extra = (state,) if len(inspect.signature(fn).parameters) > 2 else ()
    return lambda rows, start: fn(rows.transpose(0, 1), start, *extra).transpose(0, 1)


class ModelAdapter:
    """Base of every model adapter: the model's math as methods, the CP machinery once.

    Subclass it, set :attr:`claims` (or name the class in the entry point), and override the
    model-math methods. The machinery methods (:meth:`make_forward`, :meth:`begin`,
    :meth:`agree_inputs`, :meth:`selection`, :meth:`compress_main`, :meth:`compress_indexer`,
    :meth:`run_attention`, :meth:`extract_ori_kv`) are what the torch plugin's hooks call; a
    model does not override them (V4.1 extends :meth:`selection` and :meth:`begin` for its
    candidate blocks and recorded boundaries).

    Args:
        module: the layer this adapter drives (one adapter per layer, built at install).
    """

    claims: ClassVar[tuple[str, ...]] = ()
    """Qualified names of the modeling classes this adapter runs (``"package.module.Class"``),
    read when the entry point's name is not itself a class name."""

    state_class: ClassVar[type[ForwardState]] = ForwardState
    """The :class:`ForwardState` (sub)class one forward's values travel in."""

    packed_topk_row: ClassVar[str | None] = None
    """How the model on one process picks its indexer top-k with packed documents (Note [The
    one-process top-k row] in :mod:`hp_cp_core.columns`): ``"document"`` (each document
    alone), ``"stream"`` (one row for the packed stream), or ``None``: hp_cp's
    device-independent top-k (lower slot id first on ties)."""

    detach_indexer_inputs: ClassVar[bool] = True
    """Whether the indexer's compressor and queries see detached inputs (Megatron: the
    indexer is trained by its loss only)."""

    index_keys_without_grad: ClassVar[bool] = False
    """Whether :meth:`compress_index_keys` runs under ``torch.no_grad()`` (a model whose
    indexer only feeds integer picks and gets no gradient at all: HF's and NeMo's V4)."""

    sequence_dim: ClassVar[int] = 1
    """The dimension of the layer's hidden rows that runs along the sequence: 1 for
    batch-major ``[B, L, hidden]`` (the default), 0 for sequence-major ``[L, B, hidden]``
    (Megatron's). The machinery hands the hooks batch-major rows either way and returns the
    layer's output in the model's layout, so a sequence-major adapter needs no transposes; the
    rows the layer sees along it are checked against the sequence ``handle.shard`` /
    ``handle.batch`` cut for this forward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    # ------------------------------------------------------------------ model math
    def layer_spec(self) -> LayerSpec:
        """The layer's compress ratio (0, 4 or 128), window and indexer.

        Called when ``enable_cp`` plans the layers (before install) and after install by
        the core; must not depend on the input.
        """
        raise NotImplementedError(f"{type(self).__name__}.layer_spec")

    def hidden_size(self) -> int | None:
        """The width of the layer's input rows, checked before any exchange; ``None``: read
        ``module.config.hidden_size``."""
        return None

    def read_inputs(
        self,
        hidden_states: Any,
        position_ids: Any = None,
        cu_seqlens: Any = None,
        loss_mask: Any = None,
    ) -> LayerInputs:
        """Map the layer's forward arguments (as the model calls it) to :class:`LayerInputs`.

        Called first in every CP forward, with exactly the arguments the layer got. The
        default reads ``forward(hidden_states, position_ids=None, cu_seqlens=None,
        loss_mask=None)``; override it for another signature. Returns the inputs (a missing
        value is ``None``).
        """
        return LayerInputs(hidden_states, position_ids, cu_seqlens, loss_mask)

    def project(self, state: ForwardState) -> Projection:
        """The layer's queries and shared KV row for the local rows ``state.hidden`` at
        ``state.positions`` (the model's own ops: they run unchanged on local rows).

        Called once per forward, before any exchange, with gradients enabled.
        """
        raise NotImplementedError(f"{type(self).__name__}.project")

    def compress(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        """The main compressor on the rows ``[B, n, hidden]`` of one document, ``start`` the
        document-relative position of ``rows[:, 0]`` (a multiple of the ratio ``r``, or one
        block earlier for r = 4's overlap, whose slot is dropped).

        Called per document segment on each rank (``n`` may be 0: return ``[B, 0, D]``, with
        the parameters in the graph). Returns the slots ``[B, n // r, D]``, slot ``j`` at
        position ``start + j*r``. Only for layers with r > 0. A compressor that needs the
        forward's values (a rotary table the model passes per call, say) takes a third
        argument, ``compress(rows, start, state)``: the :class:`ForwardState`.
        """
        raise NotImplementedError(f"{type(self).__name__}.compress")

    def compress_index_keys(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        """The indexer's compressor, called as :meth:`compress` (rows detached when
        :attr:`detach_indexer_inputs`, without autograd when :attr:`index_keys_without_grad`;
        a third argument gets the state). Returns ``[B, n // r, D_I]``. Only for CSA layers
        with an indexer."""
        raise NotImplementedError(f"{type(self).__name__}.compress_index_keys")

    def index_queries(self, state: ForwardState) -> Any:
        """What the indexer scores with (e.g. its roped queries and per-head weights), from
        ``state.hidden``, ``state.positions`` and ``state.projection.index_input`` (detached
        when :attr:`detach_indexer_inputs`). Called once per forward of a CSA layer; the
        result is ``state.index_queries``. ``None``: nothing to prepare."""
        return None

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        """Indexer scores ``[B, hi - lo, s]`` of the local queries ``lo:hi`` over ``keys``
        ``[B, s, D_I]`` (some compressed slots). Called chunk by chunk, without gradient for
        the selection (and with it, at the picks only, for the indexer loss)."""
        raise NotImplementedError(f"{type(self).__name__}.index_scores")

    def index_scores_at(
        self, state: ForwardState, keys: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """Indexer scores ``[B, L, k]`` of each local query at its own picks ``selected``
        (global slot ids into ``keys [B, N, D_I]``, ``-1`` = none: any value), with gradient
        (the indexer loss's student). Called once per forward, only with an indexer loss. The
        default takes ``state.index_queries`` as ``(queries [B, L, h, D_I], weights [B, L, h])``
        and scores ``sum_h w * ReLU(q . k)`` (DeepSeek's indexer)."""
        queries, weights = state.index_queries
        return indexer_scores_at(queries, weights, keys, selected)

    def index_topk(self) -> int:
        """How many slots the indexer keeps per query."""
        raise NotImplementedError(f"{type(self).__name__}.index_topk")

    def sink(self) -> torch.Tensor:
        """The per-head sink logits ``[H]`` (inside the softmax's max and denominator)."""
        raise NotImplementedError(f"{type(self).__name__}.sink")

    def scale(self) -> float:
        """The attention's softmax scale."""
        raise NotImplementedError(f"{type(self).__name__}.scale")

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """The layer output ``[B, L, ...]`` from the attention result ``o [B, L, H, D]`` (e.g.
        inverse RoPE, output projection)."""
        raise NotImplementedError(f"{type(self).__name__}.output")

    def finish(self, out: torch.Tensor, state: ForwardState) -> Any:
        """The layer's return value from :meth:`output`'s (default: it, as ``[L, ...]`` for
        packed ``[L, hidden]`` input)."""
        hidden = state.inputs.hidden
        return out[0] if state.inputs.cu_seqlens is not None and hidden.dim() == 2 else out

    def indexer_loss_coeff(self) -> float | None:
        """The indexer loss's weight in the output's gradient, or ``None``: no indexer loss
        (the default)."""
        return None

    def record_indexer_loss(self, loss: torch.Tensor | None) -> None:
        """Keep this forward's indexer loss (the global mean, the same on every rank; ``None``
        without one). Default: ``module.indexer_loss`` (``None`` is set only on a module that
        has the attribute)."""
        if loss is not None or hasattr(self.module, "indexer_loss"):
            self.module.indexer_loss = loss

    def model_attention(self, request: AttentionRequest, state: ForwardState) -> Any:
        """The model's own attention op order, in the model's dtype, on the plan's columns
        (``attention_kernel="model_ops"`` or ``attention_precision="model"``; Note [Attention
        precision] in :mod:`hp_cp_torch.precision`), or ``None`` (the default): it has none;
        the configured kernel runs (the ``model_ops`` kernel: the small-op one, in fp32)."""
        return None

    # ------------------------------------------------------------------ machinery
    def layer_name(self) -> str:
        """How errors name the layer."""
        return type(self.module).__name__

    def extract_ori_kv(self, key: torch.Tensor) -> torch.Tensor:
        """The window KV rows ``[L, B, D]`` from what :meth:`make_forward` passed."""
        return key

    def state(self, call: DeepSeekV4CPContext) -> ForwardState:
        """This forward's state."""
        return call.extra["state"]

    def compress_main(self, x: Any, halo_x: Any, call: DeepSeekV4CPContext) -> torch.Tensor:
        compress = _seq_major(self.compress, self.state(call))
        return stage1_compress_with_halo(compress, x, halo_x, call)

    def compress_indexer(self, x: Any, halo_x: Any, call: DeepSeekV4CPContext) -> torch.Tensor:
        if self.detach_indexer_inputs:
            x, halo_x = x.detach(), None if halo_x is None else halo_x.detach()
        keys = _seq_major(self.compress_index_keys, self.state(call))
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.index_keys_without_grad):
            return stage1_compress_with_halo(keys, x, halo_x, call)

    def select(self, state: ForwardState, call: DeepSeekV4CPContext) -> torch.Tensor | None:
        """The indexer's top-k over each local query's visible slots (global slot ids,
        ``-1`` = none), or ``None`` without an indexer."""
        if call.cmp_idx_global is None:
            return None
        keys = call.cmp_idx_global.transpose(0, 1)  # [B, N, D_I]
        with torch.no_grad():  # the picks are discrete; the loss's student is recomputed
            return select_topk_chunked(
                lambda lo, hi, s0, s1: self.index_scores(state, lo, hi, keys[:, s0:s1]),
                call.plan,
                self.index_topk(),
                call.config.query_chunk,
                batch=state.hidden.shape[0],
                score_heads=self.index_heads(),
                one_process_row=self.packed_topk_row,
                sequence_rows=call.sequence_rows,
                cu_seqlens=call.cu_seqlens,
            )

    def index_heads(self) -> int:
        """The indexer heads :meth:`index_scores` scores before summing them.

        Called once per forward, before the top-k; it bounds each score chunk's
        ``[rows, heads, slots]`` intermediate (``select_topk_chunked``'s ``score_heads``).
        Returns 1 (the default) when the scores hold no per-head intermediate.
        """
        return 1

    def attend(self, request: AttentionRequest, state: ForwardState, kernel: Any) -> torch.Tensor:
        """The attention of ``request`` by ``kernel`` (the configured kernel's registered
        name, :mod:`hp_cp_torch.kernels.registry`); the result ``[B, L, H, D]`` goes to
        :meth:`output`. A model whose attention is not the family's shared-KV attention (say,
        MLA's latents) overrides it."""
        return run_sparse_attention(
            request.q,
            request.ori_ext,
            request.cmp_kv,
            request.plan,
            request.selected,
            request.sink,
            request.scale,
            kernel=kernel,
            query_chunk=request.query_chunk,
        )

    def selection(self, state: ForwardState, call: DeepSeekV4CPContext) -> torch.Tensor | None:
        """The picks this forward attends to: those of the layer it shares them with
        (``call.reused``, Note [Layers that share their indexer]), else :meth:`select`'s;
        published for the layers that share them, and kept as ``state.selected``."""
        if "selection" in call.reused:
            selected = call.reused["selection"]
        else:
            if call.cmp_idx_global is not None and state.index_queries is None:
                state.index_queries = self.index_queries(state)
            selected = self.select(state, call)
        if selected is not None and call.roles is not None and call.roles.publishes("selection"):
            call.outputs["selection"] = selected
        state.selected = selected
        return selected

    def run_attention(self, query, ori_ext, x, qr, call: DeepSeekV4CPContext) -> Any:
        """Stage 4 on this rank's queries: the picks, the attention (a registered kernel, or
        :meth:`model_attention` in the model's precision), :meth:`output`, the indexer loss.
        ``query`` is ``None`` when :meth:`project` left it to its ``local_work``."""
        state = self.state(call)
        selected = self.selection(state, call)
        q = state.projection.query if query is None else query.transpose(0, 1)
        kv_ext = ori_ext.transpose(0, 1)  # [B, E, D]
        cmp_kv = None if call.cmp_kv_global is None else call.cmp_kv_global.transpose(0, 1)
        sink, scale = self.sink(), self.scale()
        request = AttentionRequest(
            q, kv_ext, cmp_kv, call.plan, selected, sink, scale, call.config.query_chunk
        )
        o = self.model_attention(request, state) if uses_model_precision(call.config) else None
        out = self.output(
            o if o is not None else self.attend(request, state, call.config.attention_kernel), state
        )
        coeff = self.indexer_loss_coeff()
        if coeff is None or selected is None or call.cmp_idx_global is None:
            self.record_indexer_loss(None)
            return out
        keys = call.cmp_idx_global.transpose(0, 1)
        student = self.index_scores_at(state, keys, selected)
        self._check_student_once(state, keys, selected, student)
        share = indexer_loss_share(
            call, q, kv_ext, cmp_kv, selected, student, sink, scale, state.loss_mask
        )
        # the global mean, the same on every rank (Note [Indexer loss under CP]); no host sync
        self.record_indexer_loss(call.group.sum_detached(share))
        return attach_indexer_loss(out, share, coeff)

    def _check_student_once(
        self, state: ForwardState, keys: Any, selected: Any, student: Any
    ) -> None:
        """Warn (once per layer) when the default :meth:`index_scores_at` (DeepSeek's
        formula) scores otherwise than the model's :meth:`index_scores`: its indexer loss
        would silently train another score. A warning, not an error: a rank whose queries
        have no picks cannot compare, and an error on some ranks only would hang the rest."""
        if type(self).index_scores_at is not ModelAdapter.index_scores_at:
            return
        if self.__dict__.setdefault("_student_checked", False):
            return
        self.__dict__["_student_checked"] = True

        def scores(lo: int, hi: int, keys: Any) -> Any:
            return self.index_scores(state, lo, hi, keys)

        problem = student_mismatch(scores, keys, selected, student)
        if problem is not None:
            warnings.warn(f"{self.layer_name()} under CP: {problem}", stacklevel=2)

    def check_tensors(self, inputs: LayerInputs, group: Any) -> TensorChecks:
        """The input tensors' checks (dims, width, dtype, device, the per-row inputs' shapes)
        and their signature, recorded, never raised (they are raised on every rank).

        Called first in every CP forward, before any exchange. The default takes
        ``x [B, L, hidden]`` (or ``[L, hidden]`` / ``[B, L, hidden]`` packed) of the
        parameters' dtype and device, ``position_ids`` / ``loss_mask`` of one value per row.
        """
        return check_reference_inputs(
            self.module,
            getattr(group, "device", None),
            inputs.hidden,
            inputs.position_ids,
            inputs.loss_mask,
            inputs.cu_seqlens is not None,
            hidden_size=self.hidden_size(),
            where=f"{self.layer_name()} under CP",
        )

    def problems(self, inputs: LayerInputs) -> list[str]:
        """What CP cannot compute in this call that the tensors do not show (a cache, dropout
        in training, a framework's own CP switched on), as messages with the fix (the layer's
        name is prepended). Called in every CP forward, before any exchange; raised on every
        rank. Default: none."""
        return []

    def value_checks(self, inputs: LayerInputs, plan: Any) -> list[tuple[Any, str]]:
        """Checks that read tensor values, as ``(flag, message)`` (a 0-dim bool tensor on
        the device, or a bool; ``True`` fails): e.g. position ids against ``plan.positions``.
        Called once the plan exists; the flags ride on the agreement's one gather (no host
        read of their own). Default: none."""
        return []

    def checked_objects(self, inputs: LayerInputs) -> tuple[Any, ...] | None:
        """The identities of what :meth:`value_checks` reads: a later layer of the same
        forward handed the very same objects skips its value checks. ``None`` (the
        default): never skip."""
        return None

    def agree_inputs(
        self, cp_forward: Any, group: Any, inputs: LayerInputs
    ) -> tuple[DeepSeekV4CPContext, torch.Tensor | None]:
        """Check one forward's inputs on every rank, before any exchange, and agree on them
        (Note [Validate, agree, then communicate] in :mod:`hp_cp_core.validation`):
        :meth:`check_tensors`, :meth:`problems`, the kernel, the plan, :meth:`value_checks`
        (deferred into the agreement's gather, or read here once when the agreement is
        reused or local) and the indexer loss's row count.

        Returns:
            The agreed context and the ``[B, L]`` rows that count in the indexer loss
            (``None``: all, or no loss).
        """
        x = inputs.hidden
        checks = self.check_tensors(inputs, group)
        for message in self.problems(inputs):
            checks.fail(message)
        if isinstance(x, torch.Tensor):
            checks.kernel(cp_forward.config.attention_kernel, x.device)
        check = cp_forward.inspect(
            rows_hint(x, -2),
            checks.host_cu_seqlens(inputs.cu_seqlens),
            problems=checks.problems,
            signature=checks.signature,
        )
        memo, index = getattr(cp_forward, "memo", None), getattr(cp_forward, "index", 0)
        with_loss = self.indexer_loss_coeff() is not None
        counted = with_loss and inputs.loss_mask is not None  # a per-rank count to sum
        reuse = memo is not None and cp_forward.reuses_agreement(counted)
        across = not reuse and group.size > 1 and cp_forward.config.check_inputs_across_ranks
        if not check.ok:
            if across:  # every rank defers one entry, whatever its own checks found
                check.deferred = [(0, ())]
            return cp_forward.agree(check), None
        xb = x[None] if x.dim() == 2 else x  # [B, L, hidden]
        mask, extra = _loss_rows(cp_forward, xb, inputs.loss_mask, with_loss)
        seen = self.checked_objects(inputs)
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
        flags = self.value_checks(inputs, check.plan)
        if memo is not None and replay is None:
            memo.checked = None
        if across:  # one entry: the first failed check's number, read in the one gather
            messages = tuple(f"{checks.where}: {message}" for _, message in flags)
            check.deferred = [(_first_failed([bad for bad, _ in flags], x.device), messages)]
        elif flags:  # nothing to ride on: read here (a reused or local agreement)
            read = torch.stack([torch.as_tensor(bad, device=x.device) for bad, _ in flags])
            for bad, (_, message) in zip(read.cpu().tolist(), flags):
                if bad:
                    check.fail(f"{checks.where}: {message}")
        call = cp_forward.agree(check, extra)
        if memo is not None and replay is None:  # reached only when every flag was clear
            memo.checked, memo.checked_index = seen, index
        return call, mask

    def begin(
        self, cp_forward: Any, group: Any, inputs: LayerInputs
    ) -> tuple[DeepSeekV4CPContext, ForwardState]:
        """:meth:`agree_inputs`, then this forward's :attr:`state_class` (the rows batch-major,
        the positions given or the plan's)."""
        call, mask = self.agree_inputs(cp_forward, group, inputs)
        x = inputs.hidden
        xb = x[None] if x.dim() == 2 else x  # [B, L, hidden]
        positions = inputs.position_ids
        if positions is None:
            positions = torch.as_tensor(call.positions, device=x.device)
        positions = positions.reshape(-1, xb.shape[1]).expand(xb.shape[0], -1)
        return call, self.state_class(inputs, xb, positions, loss_mask=mask)

    def make_forward(self, cp_forward: Any, group: Any) -> Callable[..., Any]:
        """The layer's forward under CP: :meth:`read_inputs`, :meth:`begin` (check, agree,
        state), :meth:`project`, the core's CP forward (the stages call :meth:`compress_main`,
        :meth:`compress_indexer`, :meth:`run_attention`), :meth:`finish`."""
        adapter = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            inputs = adapter.read_inputs(*args, **kwargs)
            seq_major = (
                adapter.sequence_dim == 0
                and isinstance(inputs.hidden, torch.Tensor)
                and inputs.hidden.dim() == 3
            )
            if seq_major:  # the hooks see batch-major rows
                inputs.hidden = inputs.hidden.transpose(0, 1)
            call, state = adapter.begin(cp_forward, group, inputs)
            state.projection = proj = adapter.project(state)
            out = cp_forward(
                None if proj.query is None else proj.query.transpose(0, 1),
                proj.kv.transpose(0, 1),
                state.hidden.transpose(0, 1),
                None,
                call=call,
                local_work=proj.local_work,
                state=state,
            )
            return adapter.finish(out.transpose(0, 1) if seq_major else out, state)

        own = inspect.signature(adapter.read_inputs)  # the layer's own arguments
        forward.__signature__ = own.replace(return_annotation=inspect.Signature.empty)
        return forward


def _first_failed(flags: list[Any], device: Any) -> Any:
    """``k`` (a 0-dim int64 tensor on ``device``, not read): the number of the first failed
    flag, 1-based; 0 when none failed (or there are none)."""
    if not flags:
        return 0
    failed = torch.stack([torch.as_tensor(f, device=device).reshape(()).bool() for f in flags])
    number = torch.arange(1, len(flags) + 1, device=device)
    return torch.where(failed, number, len(flags) + 1).min() % (len(flags) + 1)


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


def refuse(message: str) -> type[ModelAdapter]:
    """An adapter class that refuses its claimed modules with ``HpCpError(message)`` (a model
    hp_cp cannot run exactly, registered so ``enable_cp`` says why instead of "no layer")."""

    class Refusal(ModelAdapter):
        def __init__(self, module: nn.Module) -> None:
            raise HpCpError(message)

    return Refusal
