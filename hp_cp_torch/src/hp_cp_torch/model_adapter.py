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
``model_attention``     optional: the model's own attention op order (``"model_ops"``)
======================  ====================================================================

Everything else is machinery, here once: the input checks and their agreement across ranks
(before any exchange), the compressor's halo and the slot exchange (the core), the indexer's
selection over the visible slots (with the one-process top-k row when the model's own
``torch.topk`` ties must be matched), the attention kernel (:mod:`hp_cp_torch.kernels.registry`),
the indexer loss, install and undo. One forward's values travel in a typed
:class:`ForwardState` (``call.extra["state"]``), not in string-keyed dictionaries.

Rows, positions and documents: ``compress`` is called once per document segment that starts
on a block boundary, with ``start`` the document-relative position of its first row (so a
compressor that ropes slot ``j`` at ``start + j*r`` is exact); with packed input the positions
a layer sees restart at 0 per document. ``None`` from an optional method means "the model has
none" (no indexer loss, no own op order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hp_cp_core import DeepSeekV4CPContext, HpCpError, LayerSpec, stage1_compress_with_halo
from hp_cp_torch.attention import run_sparse_attention, select_topk_chunked
from hp_cp_torch.indexer_loss import attach_indexer_loss, indexer_loss_share, indexer_scores_at
from hp_cp_torch.kernels.registry import AttentionRequest, uses_model_op_order
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
    """

    query: torch.Tensor
    kv: torch.Tensor
    index_input: Any = None


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
    """

    inputs: LayerInputs
    hidden: torch.Tensor
    positions: torch.Tensor
    projection: Projection | None = None
    loss_mask: torch.Tensor | None = None
    index_queries: Any = None


def _seq_major(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn(rows [B, n, C], start)`` for the core's sequence-major rows ``[n, B, C]``."""
    return lambda rows, start: fn(rows.transpose(0, 1), start).transpose(0, 1)


class ModelAdapter:
    """Base of every model adapter: the model's math as methods, the CP machinery once.

    Subclass it, set :attr:`claims` (or name the class in the entry point), and override the
    model-math methods. The machinery methods (:meth:`make_forward`, :meth:`compress_main`,
    :meth:`compress_indexer`, :meth:`run_attention`, :meth:`extract_ori_kv`) are what the
    torch plugin's hooks call; a model does not override them.

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
        position ``start + j*r``. Only for layers with r > 0.
        """
        raise NotImplementedError(f"{type(self).__name__}.compress")

    def compress_index_keys(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        """The indexer's compressor, called as :meth:`compress` (rows detached when
        :attr:`detach_indexer_inputs`). Returns ``[B, n // r, D_I]``. Only for CSA layers
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
        without one). Default: ``module.indexer_loss``."""
        self.module.indexer_loss = loss

    def model_attention(self, request: AttentionRequest, state: ForwardState) -> Any:
        """The model's own attention op order on the plan's columns (``attention_kernel=
        "model_ops"``), or ``None`` (the default): it has none; the ``model_ops`` kernel runs."""
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
        return stage1_compress_with_halo(_seq_major(self.compress), x, halo_x, call)

    def compress_indexer(self, x: Any, halo_x: Any, call: DeepSeekV4CPContext) -> torch.Tensor:
        if self.detach_indexer_inputs:
            x, halo_x = x.detach(), None if halo_x is None else halo_x.detach()
        return stage1_compress_with_halo(_seq_major(self.compress_index_keys), x, halo_x, call)

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
        """Kernel ``kernel`` (a registered name) on ``request``; for one that asks for the
        model's own op order, :meth:`model_attention` when the model has one."""
        if uses_model_op_order(kernel):
            own = self.model_attention(request, state)
            if own is not None:
                return own
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

    def run_attention(self, query, ori_ext, x, qr, call: DeepSeekV4CPContext) -> Any:
        state = self.state(call)
        if call.cmp_idx_global is not None and state.index_queries is None:
            state.index_queries = self.index_queries(state)
        selected = self.select(state, call)
        q = query.transpose(0, 1)  # [B, L, H, D]
        kv_ext = ori_ext.transpose(0, 1)  # [B, E, D]
        cmp_kv = None if call.cmp_kv_global is None else call.cmp_kv_global.transpose(0, 1)
        sink, scale = self.sink(), self.scale()
        request = AttentionRequest(
            q, kv_ext, cmp_kv, call.plan, selected, sink, scale, call.config.query_chunk
        )
        out = self.output(self.attend(request, state, call.config.attention_kernel), state)
        coeff = self.indexer_loss_coeff() if selected is not None else None
        if coeff is None:
            self.record_indexer_loss(None)
            return out
        student = self.index_scores_at(state, call.cmp_idx_global.transpose(0, 1), selected)
        share = indexer_loss_share(
            call, q, kv_ext, cmp_kv, selected, student, sink, scale, state.loss_mask
        )
        # the global mean, the same on every rank (Note [Indexer loss under CP]); no host sync
        self.record_indexer_loss(call.group.sum_detached(share))
        return attach_indexer_loss(out, share, coeff)

    def agree_inputs(
        self,
        cp_forward: Any,
        group: Any,
        hidden: Any,
        *,
        cu_seqlens: Any = None,
        problems: Iterable[str] = (),
        value_checks: Callable[[Any], list[tuple[Any, str]]] | None = None,
        seen: tuple[Any, ...] | None = None,
    ) -> DeepSeekV4CPContext:
        """Check one forward's inputs on every rank, before any exchange, and agree on them.

        Called by a batch-major layer's forward (``hidden [B, L, hidden]``) with the model's
        own findings in ``problems`` (messages; the layer's name is prepended) and, in
        ``value_checks(plan)``, the checks that read tensor values (``(flag, message)``: a
        0-dim bool tensor on the device, or a bool). Their flags ride on the agreement's one
        gather when this layer agrees across ranks, else they are read here once (Note
        [Validate, agree, then communicate] in :mod:`hp_cp_core.validation`). ``seen``: the
        identities of what ``value_checks`` reads; a later layer of the same forward handed
        the very same objects skips the value checks (no host read). ``None``: never skip.

        Returns:
            The agreed context (its plan's ``positions`` are the local rows' positions).
        """
        where = f"{self.layer_name()} under CP"
        checks = TensorChecks(getattr(group, "device", None), where)
        for message in problems:
            checks.fail(message)
        ok = checks.tensor("hidden_states", hidden, (3,), "[B, L, hidden] (local rows)")
        if ok:
            width = self.hidden_size() or int(self.module.config.hidden_size)
            if hidden.shape[-1] != width:
                checks.fail(
                    f"hidden_states has hidden size {hidden.shape[-1]} (shape "
                    f"{list(hidden.shape)}); the model's hidden_size is {width}. Call the "
                    "model, not the layer, or pass the decoder layer's normalised input."
                )
            checks.sign({"hidden_states": hidden.transpose(0, 1)})
            checks.kernel(cp_forward.config.attention_kernel, hidden.device)
            if cu_seqlens is not None and hidden.shape[0] != 1:
                checks.fail(
                    f"packed input (cu_seqlens) needs batch size 1, got {hidden.shape[0]}; "
                    "pack the documents of a batch into one row."
                )
        check = cp_forward.inspect(
            rows_hint(hidden, 1),
            checks.host_cu_seqlens(cu_seqlens),
            problems=checks.problems,
            signature=checks.signature,
        )
        if value_checks is None or not check.ok:
            return cp_forward.agree(check)
        memo, index = getattr(cp_forward, "memo", None), getattr(cp_forward, "index", 0)
        reuse = memo is not None and cp_forward.reuses_agreement()
        # a group of one never reuses an agreement (there is none); a later layer of the same
        # forward (a higher index) given the very objects its first layer checked skips too
        same_forward = group.size == 1 and memo is not None and index > memo.checked_index
        if seen is not None and (reuse or same_forward) and memo.checked == seen:
            return cp_forward.agree(check)  # this forward's first layer checked them
        flags = [(bad, f"{where}: {message}") for bad, message in value_checks(check.plan)]
        if memo is not None:
            memo.checked = None
        if not reuse and group.size > 1 and cp_forward.config.check_inputs_across_ranks:
            check.deferred = flags  # read in the agreement's one gather, on every rank
        elif flags:  # nothing to ride on: read here (a reused or local agreement)
            read = torch.stack([torch.as_tensor(bad, device=hidden.device) for bad, _ in flags])
            for bad, (_, message) in zip(read.cpu().tolist(), flags):
                if bad:
                    check.fail(message)
        call = cp_forward.agree(check)
        if memo is not None:  # reached only when every flag was clear
            memo.checked, memo.checked_index = seen, index
        return call

    def make_forward(self, cp_forward: Any, group: Any) -> Callable[..., Any]:
        """The layer's forward under CP: read and check the inputs, agree on them across
        ranks (Note [Validate, agree, then communicate] in :mod:`hp_cp_core.validation`),
        project, and run the core's CP forward with this forward's :class:`ForwardState`."""
        adapter = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            inputs = adapter.read_inputs(*args, **kwargs)
            x, packed = inputs.hidden, inputs.cu_seqlens is not None
            checks = check_reference_inputs(
                adapter.module,
                getattr(group, "device", None),
                x,
                inputs.position_ids,
                inputs.loss_mask,
                packed,
                hidden_size=adapter.hidden_size(),
            )
            if isinstance(x, torch.Tensor):
                checks.kernel(cp_forward.config.attention_kernel, x.device)
            check = cp_forward.inspect(
                rows_hint(x, -2),
                checks.host_cu_seqlens(inputs.cu_seqlens),
                problems=checks.problems,
                signature=checks.signature,
            )
            mask, loss_rows = None, None
            with_loss = adapter.indexer_loss_coeff() is not None
            if check.ok:
                xb = x[None] if packed and x.dim() == 2 else x  # [B, L, hidden]
                mask, loss_rows = _loss_rows(cp_forward, xb, inputs.loss_mask, with_loss)
            call = cp_forward.agree(check, {"loss_rows": loss_rows})
            positions = inputs.position_ids
            if positions is None:
                positions = torch.as_tensor(call.positions, device=x.device)
            positions = positions.reshape(-1, xb.shape[1]).expand(xb.shape[0], -1)
            state = adapter.state_class(inputs, xb, positions, loss_mask=mask)
            state.projection = proj = adapter.project(state)
            out = cp_forward(
                proj.query.transpose(0, 1),
                proj.kv.transpose(0, 1),
                xb.transpose(0, 1),
                None,
                call=call,
                state=state,
            )
            return adapter.finish(out, state)

        return forward


def _loss_rows(cp_forward: Any, xb: torch.Tensor, loss_mask: Any, with_loss: bool) -> Any:
    """``(mask [B, L] or None, rows)``: the local rows that count in the indexer loss and how
    many (``None`` without a loss); the rows ``handle.shard(..., pad_value=)`` appended never
    count."""
    if not with_loss:
        return None, None
    real = cp_forward.real_rows(xb.shape[1])
    real_t = None if real is None else torch.as_tensor(real, device=xb.device)
    if loss_mask is not None:
        keep = loss_mask.reshape(-1, xb.shape[1]) != 0
        keep = keep if real_t is None else keep & real_t
        mask = keep.expand(xb.shape[0], -1)
        return mask, int(mask.sum())
    if real_t is not None:  # N = batch x real rows, known on the host
        return real_t.reshape(1, -1).expand(xb.shape[0], -1), int(xb.shape[0]) * int(real.sum())
    return None, int(xb.shape[0] * xb.shape[1])  # every row counts


def refuse(message: str) -> type[ModelAdapter]:
    """An adapter class that refuses its claimed modules with ``HpCpError(message)`` (a model
    hp_cp cannot run exactly, registered so ``enable_cp`` says why instead of "no layer")."""

    class Refusal(ModelAdapter):
        def __init__(self, module: nn.Module) -> None:
            raise HpCpError(message)

    return Refusal
