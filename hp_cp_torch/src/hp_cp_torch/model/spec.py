"""The model-adapter spec: the hooks a model fills to run under CP (:data:`REQUIRED`: which).

A model adapter subclasses :class:`ModelAdapter`, fills the hooks its model needs and is
registered under the entry-point group ``hp_cp.torch_models``. As pluggy separates a hookspec
from its ``PluginManager``, this is the spec and :mod:`hp_cp_torch.model.runner` the machinery,
which no subclass can override. ``docs/writing-a-model-adapter.md``'s table is generated from the
hooks' docstrings and :data:`REQUIRED`. An adapter written against 0.3.0 keeps working: each 0.3
name it defines warns, naming the hook that replaces it (:data:`RENAMED_0_3`), and runs as that
hook.

Note [Hooks checked when a model is defined]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
As pluggy's ``check_pending`` refuses a hook implementation no spec declares, a subclass is
checked when its class statement runs (``__init_subclass__``, so at import): its public names
are the spec's (or 0.3's, which warn). A runner step (:data:`MACHINERY`), any other public
name (a misspelled hook: ``index_score``) or a missing hook every layer needs raises an
``HpCpError`` naming it and the nearest spec name. A model's own helpers are private
(``_rope``), as pytest's plugins keep their helpers out of the ``pytest_`` namespace; a base
class that leaves hooks to its subclasses says so: ``class Base(ModelAdapter, abstract=True)``.
The hooks a layer needs by what it does (its ``LayerSpec``, its attention's kind) are checked
when ``enable_cp`` installs it (:func:`check_layer_hooks`), before any collective.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from hp_cp_core import HpCpError, LayerSpec
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.model.indexer_loss import indexer_scores_at
from hp_cp_torch.model.validation import TensorChecks

__all__ = [
    "MACHINERY",
    "RECORDED",
    "REQUIRED",
    "AttentionParams",
    "ForwardState",
    "IndexerParams",
    "Latent",
    "LayerInputs",
    "LayerKind",
    "ModelAdapter",
    "ModelHandle",
    "PlanView",
    "Projection",
    "Traits",
    "check_layer_hooks",
]

RECORDED: Any = SimpleNamespace(name="RECORDED")
"""``LayerInputs(cu_seqlens=RECORDED)``: the packed boundaries the batch recorded (for a model
that hands its layers per-row document ids), put in by hp_cp before the checks."""


@dataclass
class LayerInputs:
    """A layer forward's arguments (:meth:`ModelAdapter.read_inputs`); subclass it for the
    model's own (a rotary table, a mask), read by every hook as ``state.inputs``.

    Attributes:
        hidden: the local rows ``[B, L, hidden]``, or ``[L, hidden]`` / ``[1, L, hidden]``
            with ``cu_seqlens`` (packed); batch-major whatever :attr:`Traits.sequence_dim`.
        position_ids: ``[L]`` or ``[B, L]`` (packed: per document), or ``None``: the plan's.
        cu_seqlens: the global document boundaries ``[0, ..., S]``, :data:`RECORDED` or ``None``.
        loss_mask: rows that count in the indexer loss (``[L]`` or ``[B, L]``), or ``None``.
        real_rows: set by hp_cp: the global rows before the layout's padding, or ``None``.
    """

    hidden: Any
    position_ids: Any = None
    cu_seqlens: Any = None
    loss_mask: Any = None
    real_rows: int | None = None


@dataclass
class Projection:
    """What :meth:`ModelAdapter.project` returns for the local rows.

    Attributes:
        query: ``[B, L, H, D]``, roped (latent attention: ``D`` is ``nope + rope``).
        kv: the shared KV head ``[B, L, D]`` (keys = values), roped; latent: ``[c ; k_rot]``;
            grouped: ``[k_0 .. k_{G-1} ; v_0 .. v_{G-1}]`` (:class:`AttentionParams`).
        index_input: what :meth:`ModelAdapter.index_queries` needs beyond the state, or ``None``.
        index_keys: with :attr:`Traits.rows_are_slots`, each row's indexer key ``[B, L, D_I]``.
        local_work: callables run while the exchanges travel (the first during the halo
            exchange, the rest during the slot exchange; Note [Overlapped exchanges] in
            :mod:`hp_cp_core.collectives`); they may set ``state.projection.query``.
    """

    query: torch.Tensor | None
    kv: torch.Tensor
    index_input: Any = None
    index_keys: torch.Tensor | None = None
    local_work: tuple[Callable[[], None], ...] = ()


@dataclass(frozen=True)
class PlanView:
    """What a hook may read of this rank's plan (``state.view``; ``value_checks``'s ``plan``),
    a frozen record of copies: one entry per local row unless said otherwise.

    Attributes:
        positions: ``[L]`` the rows' positions (the global row, or the position within the
            document when packed).
        rows: ``[L]`` the rows' global row numbers.
        total_rows: the sequence's rows, the layout's padding included.
        real_rows: the rows before the layout's padding, or ``None``: no padding.
        cu_seqlens: the global document boundaries ``[0, ..., S]`` (packed), or ``None``.
        slot_start: ``[L]`` the first slot each row sees (global slot id).
        slot_count: ``[L]`` how many slots it sees from there (causal; its document's).
        runs: the local rows' runs of consecutive global rows, ``(local start, local stop,
            global start)`` each (one when contiguous, two per rank load-balanced).
    """

    positions: np.ndarray
    rows: np.ndarray
    total_rows: int
    real_rows: int | None
    cu_seqlens: np.ndarray | None
    slot_start: np.ndarray
    slot_count: np.ndarray
    runs: tuple[tuple[int, int, int], ...] = ()
    _plan: Any = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, plan: Any, real_rows: int | None = None, cu_seqlens: Any = None) -> PlanView:
        """The view of a core ``RankPlan``: copies of its arrays, so a hook that writes into
        one (or hands it to ``torch.as_tensor``, which warns on a read-only array) never
        changes the plan."""

        def frozen(a: Any) -> np.ndarray:
            return np.array(a)

        cu = None if cu_seqlens is None else frozen(cu_seqlens)
        return cls(
            frozen(plan.positions),
            frozen(plan.local_rows),
            int(plan.layout.total_rows),
            real_rows,
            cu,
            frozen(plan.cmp_start),
            frozen(plan.cmp_count),
            tuple((int(a), int(b), int(g)) for a, b, g in plan.runs),
            plan,
        )

    def __getattr__(self, name: str) -> Any:
        """A ``RankPlan`` field an adapter written against 0.4 reads (deprecated)."""
        return _deprecated_read(self, "_plan", name, "the plan handed to a hook")


def _view_fields(cls: type = PlanView) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))


def _deprecated_read(view: Any, held: str, name: str, what: str) -> Any:
    """``name`` of the object a view holds in its field ``held``, read through the view by
    an adapter written against 0.4, with a ``DeprecationWarning`` naming the view's fields."""
    target = view.__dict__.get(held)
    if name.startswith("__") or target is None or not hasattr(target, name):
        raise AttributeError(name)
    cls = type(view)
    warnings.warn(
        f"reading {name} of {what} is deprecated since 0.5.0 and removed in 0.6.0: read the "
        f"fields of hp_cp_torch.model.spec.{cls.__name__} ({_view_fields(cls)}).",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(target, name)


@dataclass(frozen=True)
class ModelHandle:
    """What :meth:`ModelAdapter.prepare_model` may read and do of the ``enable_cp`` handle
    (``handle``): a frozen record, so that model files never hold the core's handle, its
    group or its records.

    Attributes:
        cp_size: the CP group's ranks.
        rank: this rank in the CP group.
        config: the ``enable_cp`` options (``CPConfig``, frozen).
        on_disable: ``on_disable(fn)``: ``disable_cp`` runs ``fn`` (a hook's ``remove``).
        documents: ``documents(rows)``: the global document boundaries ``[0, ..., rows]``
            the running forward's batch recorded (``handle.batch(..., cu_seqlens=)``,
            ``cp_nemo_batch``) for a sequence of ``rows`` rows, or ``None`` (none recorded,
            or for another length); a model-level forward reads them under CP.
        row_exchange: ``row_exchange(window, name) -> RowExchange``: other ranks' rows of a
            side tensor of the model's (not the layer's K/V: V4.1's Engram token ids), by a
            plan of ``window`` rows back per row, through the collectives a layer's halo
            uses, with autograd (:class:`hp_cp_torch.model.runner.RowExchange`); ``name`` says
            whose in its errors.
    """

    cp_size: int
    rank: int
    config: Any
    on_disable: Callable[[Callable[[], Any]], None]
    documents: Callable[[int], np.ndarray | None]
    row_exchange: Callable[[int, str], Any]
    _handle: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __getattr__(self, name: str) -> Any:
        """A ``CPHandle`` attribute an adapter written against 0.4 reads (deprecated)."""
        return _deprecated_read(self, "_handle", name, "the handle handed to prepare_model")


@dataclass
class ForwardState:
    """One layer's CP forward, handed to the hooks; a model adds fields in a subclass
    (``@dataclass(kw_only=True)``) named in :attr:`Traits.state_class`.

    Attributes:
        inputs: the forward's :class:`LayerInputs`; hidden: its rows ``[B, L, hidden]``.
        positions: ``[B, L]`` positions of the local rows (packed: per document).
        projection: the layer's :class:`Projection`.
        view: what the hooks may read of this rank's plan (:class:`PlanView`); ``plan``,
            the core's ``RankPlan`` itself, is deprecated since 0.5.0 (read ``view``).
        loss_mask: ``[B, L]`` bool rows that count in the indexer loss, or ``None`` (all).
        index_queries: what :meth:`ModelAdapter.index_queries` returned.
        slots: the gathered compressed slots ``[B, N, D]`` in global slot order, or ``None``.
        keys: the gathered indexer keys ``[B, N, D_I]``, or ``None``.
        selected: the picks ``[B, L, k]`` (global slot ids, ``-1`` none), or ``None``.
        candidates: the candidate blocks ``[B, L, N]`` (bool) this layer selects among,
            handed from the layer that makes them (its :meth:`ModelAdapter.block_candidates`
            sets them), or ``None``.
    """

    inputs: LayerInputs
    hidden: torch.Tensor
    positions: torch.Tensor
    projection: Projection | None = None
    loss_mask: torch.Tensor | None = None
    index_queries: Any = None
    plan: Any = None
    view: PlanView | None = None
    slots: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    selected: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


@dataclass(frozen=True)
class Traits:
    """What a model declares once, as data (``traits = Traits(...)`` on the adapter class).

    Attributes:
        state_class: the :class:`ForwardState` (sub)class one forward's values travel in.
        sequence_dim: the sequence's dimension of the layer's hidden rows: 1 (``[B, L,
            hidden]``) or 0 (``[L, B, hidden]``, Megatron's). The hooks see batch-major rows
            either way; the output is returned in the model's layout.
        packed_topk_row: the row the model's own top-k runs on (Note [The one-process top-k
            row] in :mod:`hp_cp_core.columns`): ``"document"``, ``"stream"`` (the packed
            stream's), or ``None``: hp_cp's device-independent top-k (lower slot first).
        ascending_picks: picks in ascending slot order (``topk(sorted=False)``, then sorted).
        indexer_grad: the indexer compressor's gradient: ``"loss"`` (its rows detached: the
            indexer loss only, as Megatron), ``"none"`` (no autograd: HF's, NeMo's) or
            ``"full"`` (gradients reach the layer's input through the keys). hp_cp applies
            it to :meth:`ModelAdapter.compress_index_keys`; with ``rows_are_slots`` there is
            none (``project`` makes the keys with the autograd it wants) and another value
            than the default is refused when the class is defined.
        per_forward: fields of the model's :class:`LayerInputs` that ``read_inputs`` takes
            from outside the layer's call (a model-level forward pre-hook's value: Megatron's
            ``position_ids``): hp_cp files each under this forward's record and hands a
            recomputed call (activation checkpointing) what its forward filed (Note [Model
            values per forward] in :mod:`hp_cp_torch.model.runner`).
        model_group: where a layer keeps its model's own context-parallel process group
            (an attribute path: Megatron's ``"pg_collection.cp"``; a layer without it is a
            group of its rank alone), or ``None``: hp_cp refuses, when ``enable_cp``
            installs the layer, a group whose ranks are not the handle's.
        rows_are_slots: the projection's rows are the slots (DSA): ``Projection.kv`` and
            ``Projection.index_keys``, no compressor (defining ``compress`` or
            ``compress_index_keys`` too is refused when the class is defined).
    """

    state_class: type[ForwardState] = ForwardState
    sequence_dim: int = 1
    packed_topk_row: str | None = None
    ascending_picks: bool = False
    indexer_grad: str = "loss"
    per_forward: tuple[str, ...] = ()
    model_group: str | None = None
    rows_are_slots: bool = False


@dataclass(frozen=True)
class IndexerParams:
    """The layer's indexer (:meth:`ModelAdapter.indexer_params`).

    Attributes:
        topk: the slots it keeps per query.
        heads: the heads :meth:`ModelAdapter.index_scores` sums (it bounds a score chunk).
        loss_coeff: the indexer loss's weight, or ``None``: no loss. The loss (a mean over
            the rows that count on all ranks) is attached to the layer output; its value,
            ``module.indexer_loss``, is for logging (adding it to a loss counts it twice).
        loss_mean: the loss is the mean over the rows that count on all ranks (``True``) or
            their sum (``False``: Megatron's ``calculate_per_token_loss``).
        loss_attach: ``attach(out, loss) -> out``: how the weighted loss (``loss_coeff`` x
            this rank's share) joins the output's backward, the model's way (Megatron's
            ``DSAIndexerLossAutoScaler``, which applies its schedule's loss scale) and its
            logging; hp_cp then sets no ``module.indexer_loss``. ``None``: hp_cp's
            (``loss_coeff`` seeds the share's gradient).
    """

    topk: int
    heads: int = 1
    loss_coeff: float | None = None
    loss_mean: bool = True
    loss_attach: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Latent:
    """Latent (MLA) attention's dims (``qk_nope_head_dim``, ``qk_rope_head_dim``,
    ``v_head_dim``, ``kv_lora_rank``) and ``up_proj``, ``kv_b_proj.weight`` (Note [DSA
    attention on the latents] in :mod:`hp_cp_torch.kernels.latent_attention`)."""

    nope: int
    rope: int
    value: int
    rank: int
    up_proj: torch.Tensor


ATTENTION_KINDS = ("shared_kv", "grouped", "latent", "own")


@dataclass(frozen=True)
class AttentionParams:
    """The layer's attention (:meth:`ModelAdapter.attention_params`).

    Attributes:
        scale: the softmax scale.
        sink: per-head sink logits ``[H]`` (inside the softmax), or ``None``: no sink.
        kind: ``"shared_kv"`` (one KV head whose rows are keys and values at once, by the
            configured kernel), ``"grouped"`` (grouped-query attention with keys apart from
            values: :attr:`kv_heads` KV heads, MQA to MHA), ``"latent"`` (MLA, with
            :attr:`latent`) or ``"own"`` (:meth:`ModelAdapter.attention` always: it picks its
            slots itself from ``state.keys``; hp_cp runs no selection). ``"grouped"`` and
            ``"latent"`` attend to the indexer's picks only (a layer with no window).
        latent: the dims of ``kind="latent"``.
        kv_heads: ``kind="grouped"``: the KV heads ``G`` (the query heads a multiple of it;
            query head ``j`` reads KV head ``j // (H / G)``, as ``repeat_interleave`` does).
            ``project(state).kv`` is then each token's keys, then its values:
            ``[k_0 .. k_{G-1} ; v_0 .. v_{G-1}]``, ``G * (d_k + d_v)`` wide, ``d_k`` the
            queries' head width.
    """

    scale: float | None = None
    sink: torch.Tensor | None = None
    kind: str = "shared_kv"
    latent: Latent | None = None
    kv_heads: int | None = None

    def __post_init__(self) -> None:
        latent, scaled = self.latent is not None, self.scale is not None or self.kind == "own"
        grouped = self.kind == "grouped"
        heads_ok = (self.kv_heads is not None) == grouped and (
            not grouped or (isinstance(self.kv_heads, int) and self.kv_heads >= 1)
        )
        if (
            self.kind not in ATTENTION_KINDS
            or (self.kind == "latent") != latent
            or not scaled
            or not heads_ok
        ):
            raise HpCpError(
                f"AttentionParams(kind={self.kind!r}, scale={self.scale!r}, latent given: "
                f"{latent}, kv_heads={self.kv_heads!r}): expected a kind of {ATTENTION_KINDS}, "
                "a Latent exactly for kind='latent', kv_heads >= 1 exactly for kind='grouped', "
                "and a softmax scale (but for kind='own')."
            )


@dataclass(frozen=True)
class LayerKind:
    """Layers that need a hook: ``text`` as the guide and the errors say it, ``test(spec,
    traits, kind)`` true for such a layer (its ``LayerSpec``, its model's :class:`Traits`,
    its :attr:`AttentionParams.kind`)."""

    text: str
    test: Callable[[LayerSpec, Traits, str], bool]


EVERY_LAYER = LayerKind("every layer", lambda spec, traits, kind: True)

REQUIRED: dict[str, LayerKind] = {
    "layer_spec": EVERY_LAYER,
    "project": EVERY_LAYER,
    "compress": LayerKind(
        "a layer that makes its slots (`LayerSpec.makes_compressed_kv`), unless "
        "`traits.rows_are_slots`",
        lambda spec, traits, kind: spec.makes_compressed_kv and not traits.rows_are_slots,
    ),
    "compress_index_keys": LayerKind(
        "a layer that makes its index keys (`LayerSpec.makes_index_keys`), unless "
        "`traits.rows_are_slots`",
        lambda spec, traits, kind: spec.makes_index_keys and not traits.rows_are_slots,
    ),
    "index_scores": LayerKind(
        "a layer that selects (`LayerSpec.makes_selection`), but for `kind='own'`",
        lambda spec, traits, kind: spec.makes_selection and kind != "own",
    ),
    "attention_params": EVERY_LAYER,
    "attention": LayerKind("a layer of `AttentionParams(kind='own')`", lambda s, t, k: k == "own"),
    "output": EVERY_LAYER,
}
"""The spec's required hooks -> the layers that need them, stated once: the guide's table,
the checks at class definition (every layer's) and at install (:func:`check_layer_hooks`) and
a default's error read it. Every other hook has a default that serves."""


def _hook(name: str) -> str:
    """The spec's hook ``name`` as the guide writes it: ``name(arguments)`` (a method) or
    ``name`` (a class attribute)."""
    value = inspect.getattr_static(ModelAdapter, name)
    if isinstance(value, classmethod):
        value = value.__func__
    if not callable(value):
        return name
    params = list(inspect.signature(value).parameters)[1:]  # self or cls
    return f"{name}({', '.join(params)})"


def _required(adapter: Any, hook: str) -> HpCpError:
    return HpCpError(
        f"{type(adapter).__qualname__} does not define the hook {_hook(hook)} that "
        f"{REQUIRED[hook].text} needs (docs/writing-a-model-adapter.md, the table of hooks)."
    )


class ModelAdapter:
    """The spec of a model adapter for the layer ``module`` (one adapter per layer): subclass it
    and define the hooks your model needs (Note [Hooks checked when a model is defined]).

    Attributes:
        claims: the modeling classes it runs (``"package.module.Class"``), read when the entry
            point's name is not a class name.
        traits: the model's :class:`Traits`.
        module: the layer this adapter runs (each hook reads its parameters and config).
    """

    claims: ClassVar[tuple[str, ...]] = ()
    traits: ClassVar[Traits] = Traits()
    module: nn.Module
    """The layer this adapter runs, set by ``__init__``: the hooks read its parameters, config
    and submodules (one adapter per layer)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __init_subclass__(cls, *, abstract: bool = False, **kwargs: Any) -> None:
        """Check the subclass's names (Note [Hooks checked when a model is defined]);
        ``abstract=True``: a base whose subclasses fill the hooks every layer needs."""
        super().__init_subclass__(**kwargs)
        _adopt_0_3(cls)
        _check_names(cls)
        if not abstract:
            _check_required(cls)

    @classmethod
    def prepare_model(cls, model: nn.Module, layers: list[nn.Module], handle: ModelHandle) -> None:
        """Model-level work under CP (guards, pre-hooks, another module's forward), with the
        layers of this adapter class; ``handle`` is the :class:`ModelHandle`.

        Called: in ``enable_cp`` before any layer is installed; undo through
        ``handle.on_disable(fn)``.
        Default: nothing.
        """

    def layer_spec(self) -> LayerSpec:
        """The layer's ``LayerSpec(compress_ratio, window_size, has_indexer, ...)``.

        Called: when ``enable_cp`` plans the layers, then by the core; it never depends on
        the input.
        Default: none (:data:`REQUIRED`).
        """
        raise _required(self, "layer_spec")

    def layer_name(self) -> str:
        """How error messages name the layer (``"<name> under CP: ..."``).

        Called: when a message is made.
        Default: its class name, and ``layer <layer_idx>`` where the layer has one.
        """
        index = getattr(self.module, "layer_idx", None)
        return type(self.module).__name__ + ("" if index is None else f" layer {index}")

    def read_inputs(
        self,
        hidden_states: Any,
        position_ids: Any = None,
        cu_seqlens: Any = None,
        loss_mask: Any = None,
    ) -> LayerInputs:
        """The layer's forward arguments, as the model calls the layer, as a
        :class:`LayerInputs` (a missing value is ``None``).

        Called: first in every CP forward, with exactly the layer's arguments.
        Default: ``forward(hidden_states, position_ids=None, cu_seqlens=None, loss_mask=None)``.
        """
        return LayerInputs(hidden_states, position_ids, cu_seqlens, loss_mask)

    def check_inputs(self, inputs: LayerInputs, checks: TensorChecks) -> None:
        """Record what CP cannot run in this call (a bad shape, a cache, dropout in training)
        as ``checks.fail(message)``, with the fix; every rank raises them together.

        Called: every forward, before any exchange.
        Default: ``checks.layer_input(module, inputs)``: ``x [B, L, hidden]`` (packed: ``[L,
        hidden]``) of the parameters' dtype and device, per-row ``position_ids`` / ``loss_mask``.
        """
        checks.layer_input(self.module, inputs)

    def value_checks(self, inputs: LayerInputs, plan: PlanView) -> list[tuple[Any, str]]:
        """Checks that read tensor values, as ``(flag, message)`` (a 0-dim bool tensor or a
        bool; ``True`` fails), e.g. position ids against ``plan.positions`` (the
        :class:`PlanView`); the flags ride on
        the agreement's one gather. A later layer handed the same tensors skips them.

        Called: every forward, once the plan exists.
        Default: none.
        """
        return []

    def project(self, state: ForwardState) -> Projection:
        """The queries and shared KV rows of ``state.hidden`` at ``state.positions``, by the
        model's own ops (they run unchanged on local rows).

        Called: once per forward, before any exchange, with autograd.
        Default: none (:data:`REQUIRED`).
        """
        raise _required(self, "project")

    def compress(self, rows: torch.Tensor, start: int, state: ForwardState) -> torch.Tensor:
        """The main compressor: slots ``[B, n // r, D]`` of one document's rows ``[B, n,
        hidden]`` from a block boundary (one block early for r = 4's overlap: that slot is
        dropped), slot ``j`` at position ``start + j*r``; ``state.inputs`` has the call's values.

        Called: per document segment of the rank (r > 0; ``n`` may be 0: return
        ``[B, 0, D]`` with the parameters in the graph).
        Default: none (:data:`REQUIRED`).
        """
        raise _required(self, "compress")

    def compress_index_keys(
        self, rows: torch.Tensor, start: int, state: ForwardState
    ) -> torch.Tensor:
        """The indexer's compressor, as :meth:`compress`: keys ``[B, n // r, D_I]`` (rows
        detached or without autograd as ``traits.indexer_grad`` says).

        Called: as ``compress``, for a layer whose ``LayerSpec`` has an indexer.
        Default: none (:data:`REQUIRED`).
        """
        raise _required(self, "compress_index_keys")

    def index_queries(self, state: ForwardState) -> Any:
        """What :meth:`index_scores` scores with (the indexer's roped queries and per-head
        weights, say), kept as ``state.index_queries``.

        Called: once per forward of a layer that selects, unless the projection set it.
        Default: ``None``.
        """
        return None

    def index_scores(
        self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor
    ) -> torch.Tensor:
        """Indexer scores ``[B, hi - lo, s]`` of the local queries ``lo:hi`` over ``keys [B,
        s, D_I]`` (some gathered slots), the higher the likelier picked.

        Called: chunk by chunk, without autograd, for the selection.
        Default: none (:data:`REQUIRED`).
        """
        raise _required(self, "index_scores")

    def indexer_loss_scores(
        self, state: ForwardState, keys: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """The indexer loss's student: scores ``[B, L, k]`` at each query's picks ``selected``
        (slot ids into ``keys [B, N, D_I]``, ``-1``: any), with autograd, as :meth:`index_scores`.

        Called: once per forward with an indexer loss.
        Default: DeepSeek's ``sum_h w * relu(q . k)`` from ``state.index_queries = (q [B, L,
        h, D_I], w [B, L, h])``; a model that scores otherwise defines this hook (hp_cp
        compares the two on a layer's first forward with a loss and warns).
        """
        pair = state.index_queries
        q, w = pair if isinstance(pair, tuple) and len(pair) == 2 else (pair, None)
        batch, rows, width = (*state.hidden.shape[:2], keys.shape[-1])
        if not (
            getattr(q, "shape", (0,))[:2] == (batch, rows)
            and getattr(q, "ndim", 0) == 4
            and q.shape[-1] == width
            and getattr(w, "shape", None) == q.shape[:3]
        ):
            got = [list(getattr(t, "shape", [type(t).__name__])) for t in (q, w)]
            raise HpCpError(
                f"{self.layer_name()} under CP: the default indexer_loss_scores reads "
                f"index_queries(state) as (queries [B, L, h, D_I], weights [B, L, h]) = "
                f"([{batch}, {rows}, h, {width}], [{batch}, {rows}, h]); got {got}. Return that "
                "pair from index_queries, or define indexer_loss_scores for your own scores."
            )
        return indexer_scores_at(q, w, keys, selected)

    def indexer_row_kl(self, state: ForwardState, lo: int, hi: int) -> torch.Tensor | None:
        """The model's own indexer loss: per-row ``KL(teacher || student)`` ``[B, hi - lo]``
        of the local queries ``lo:hi``, with autograd to the indexer (its queries, weights
        and ``state.keys``), from ``state`` (``slots``, ``keys``, ``selected``, ``view``);
        hp_cp sums the rows that count (``loss_mask``, real rows), normalises over all
        ranks, attaches and logs it (Note [Indexer loss under CP]).

        Called: chunk by chunk, once per forward with an indexer loss
        (``IndexerParams.loss_coeff``).
        Default: ``None``: hp_cp's (the attention's softmax over the picks, the student
        :meth:`indexer_loss_scores`).
        """
        return None

    def block_candidates(
        self, state: ForwardState, scores: torch.Tensor, lo: int, hi: int, row: Any
    ) -> torch.Tensor:
        """Candidate blocks (V4.1's two-level indexer): the one-process score rows ``scores
        [B, hi - lo, row.length]`` of queries ``lo:hi`` (slots from ``row.start``), returned
        with what they may not pick at ``-inf``; the layer that makes the candidates sets
        ``state.candidates`` (published), the others read it.

        Called: per block of rows before the top-k (with ``traits.packed_topk_row``).
        Default: the scores as they are.
        """
        return scores

    def indexer_params(self) -> IndexerParams | None:
        """The layer's :class:`IndexerParams` (top-k, score heads, loss weight).

        Called: every forward.
        Default: ``None``: no indexer of its own (a window or HCA layer, or one that reuses
        another layer's picks).
        """
        return None

    def attention_params(self) -> AttentionParams:
        """The layer's :class:`AttentionParams`: softmax scale, sink, attention kind.

        Called: every forward.
        Default: none (:data:`REQUIRED`).
        """
        raise _required(self, "attention_params")

    def attention(self, request: AttentionRequest, state: ForwardState) -> torch.Tensor | None:
        """The model's own attention op order, in the model's dtype, on the plan's columns:
        ``[B, L, H, D]``, or ``None``: it has none (the configured kernel runs).

        Called: for ``attention_kernel="model_ops"`` / ``attention_precision="model"``, and
        every forward of ``kind="own"``.
        Default: ``None`` (:data:`REQUIRED` for ``kind="own"``).
        """
        return None

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """The layer output ``[B, L, ...]`` from the attention's ``o [B, L, H, D]`` (inverse
        RoPE, output projection...).

        Called: after the attention.
        Default: none (:data:`REQUIRED`).
        """
        raise _required(self, "output")

    def finish(self, out: torch.Tensor, state: ForwardState) -> Any:
        """The layer's return value from :meth:`output`'s.

        Called: last, in the model's layout (``traits.sequence_dim``).
        Default: ``out`` (``[L, ...]`` for packed ``[L, hidden]`` input).
        """
        hidden = state.inputs.hidden
        return out[0] if state.inputs.cu_seqlens is not None and hidden.dim() == 2 else out


def refuse(message: str) -> type[ModelAdapter]:
    """An adapter class that refuses its claimed modules with ``HpCpError(message)`` (a model
    hp_cp cannot run exactly, registered so ``enable_cp`` says why instead of "no layer")."""

    class Refusal(ModelAdapter, abstract=True):  # it runs nothing: no hook is needed
        def __init__(self, module: nn.Module) -> None:
            raise HpCpError(message)

    return Refusal


# --------------------------------------------------------------------------- the checks

MACHINERY = (
    "make_forward begin agree_inputs read_objects selection select attend compress_main "
    "compress_indexer run_attention extract_ori_kv indexer_loss record_indexer_loss "
    "check_student_once expect state per_forward model_indexer_loss"
).split()
"""hp_cp's machinery: :class:`hp_cp_torch.model.runner.LayerRunner`'s steps (and 0.3's ``state``),
which no model adapter defines (``tests/torch/test_model_spec.py`` keeps it the runner's)."""


def _spec_names() -> list[str]:
    return [name for name in vars(ModelAdapter) if not name.startswith("_")]


def _nearest(name: str) -> str:
    """`` Did you mean hook(args)?`` for the spec's hook nearest ``name`` (difflib), or ``""``
    when none is near."""
    close = difflib.get_close_matches(name, _spec_names(), n=1, cutoff=0.6)
    return f" Did you mean {_hook(close[0])}?" if close else ""


def _own_names(cls: type) -> dict[str, str]:
    """The public names ``cls`` brings: its own, and those of any base between it and
    :class:`ModelAdapter` that is no adapter (a mixin, never checked itself) -> where from."""
    found: dict[str, str] = {}
    for base in reversed(cls.__mro__[: cls.__mro__.index(ModelAdapter)]):
        if base is cls or not issubclass(base, ModelAdapter):
            where = "" if base is cls else f" (from {base.__qualname__})"
            found.update({n: where for n in vars(base) if not n.startswith("_")})
    return found


def _check_names(cls: type) -> None:
    """Refuse a runner step or a name that is no hook (Note [Hooks checked when a model is
    defined]); also what ``traits.rows_are_slots`` makes meaningless."""
    own = _own_names(cls)
    machinery = [name for name in MACHINERY if name in own]
    if machinery:
        raise HpCpError(
            f"{cls.__qualname__} defines {machinery}: hp_cp's machinery "
            "(hp_cp_torch.model.runner), which a model adapter cannot override since 0.4.0. "
            "Fill the hooks of hp_cp_torch.model.spec.ModelAdapter instead "
            "(docs/writing-a-model-adapter.md)."
            + "".join(f" {n}:{_nearest(n)}" for n in machinery if _nearest(n))
        )
    spec = set(_spec_names()) | set(RENAMED_0_3)
    unknown = [name for name in own if name not in spec]
    if unknown:
        name = unknown[0]
        raise HpCpError(
            f"{cls.__qualname__} defines {name!r}{own[name]}, which is no hook of "
            f"hp_cp_torch.ModelAdapter.{_nearest(name)} A helper of the model's own is "
            f"private: _{name} (the hooks: docs/writing-a-model-adapter.md)."
            + (f" Also unknown: {unknown[1:]}." if unknown[1:] else "")
        )
    if cls.traits.rows_are_slots:
        extra = [n for n in ("compress", "compress_index_keys") if _defines(cls, n)]
        if cls.traits.indexer_grad != Traits.indexer_grad:
            extra.append(f"traits.indexer_grad={cls.traits.indexer_grad!r}")
        if extra:
            raise HpCpError(
                f"{cls.__qualname__} declares traits.rows_are_slots=True but also {extra}, "
                "which hp_cp never uses for such a model: its slots and index keys are "
                "project(state)'s (Projection.kv, Projection.index_keys), made with the "
                "autograd the model wants. Remove them (indexer_grad: leave the default)."
            )


def _defines(cls: type, hook: str) -> bool:
    """Whether ``cls`` (or a base between it and :class:`ModelAdapter`) defines ``hook``."""
    return getattr(cls, hook) is not getattr(ModelAdapter, hook)


def _check_required(cls: type) -> None:
    missing = [
        _hook(n) for n, kind in REQUIRED.items() if kind is EVERY_LAYER and not _defines(cls, n)
    ]
    if missing:
        raise HpCpError(
            f"{cls.__qualname__} does not define the hooks {missing} that every layer needs "
            "(docs/writing-a-model-adapter.md, the table of hooks). Define them, or declare a "
            f"base class that leaves them to its subclasses: class {cls.__name__}(ModelAdapter, "
            "abstract=True)."
        )


def check_layer_hooks(adapter: ModelAdapter) -> None:
    """Raise ``HpCpError`` naming each hook of :data:`REQUIRED` that ``adapter``'s layer needs
    (by its ``layer_spec()`` and ``attention_params().kind``) and its class does not define;
    called when ``enable_cp`` installs the layer, before any collective."""
    cls, spec = type(adapter), adapter.layer_spec()
    kind = adapter.attention_params().kind if _defines(cls, "attention_params") else "shared_kv"
    missing = [
        f"{_hook(n)} for {k.text}"
        for n, k in REQUIRED.items()
        if k.test(spec, cls.traits, kind) and not _defines(cls, n)
    ]
    if missing:
        raise HpCpError(
            f"{adapter.layer_name()} under CP: {cls.__qualname__} does not define the hooks its "
            f"layer needs ({spec}, kind={kind!r}): {'; '.join(missing)}. Define them "
            "(docs/writing-a-model-adapter.md, the table of hooks)."
        )


# --------------------------------------------------------------------------- 0.3 adapters

RENAMED_0_3 = {
    "state_class": "traits.state_class",
    "sequence_dim": "traits.sequence_dim",
    "packed_topk_row": "traits.packed_topk_row",
    "detach_indexer_inputs": "traits.indexer_grad",
    "index_keys_without_grad": "traits.indexer_grad",
    "compress": "compress(rows, start, state)",
    "compress_index_keys": "compress_index_keys(rows, start, state)",
    "index_scores_at": "indexer_loss_scores(state, keys, selected)",
    "index_topk": "indexer_params() -> IndexerParams(topk, heads, loss_coeff)",
    "index_heads": "indexer_params() -> IndexerParams(topk, heads, loss_coeff)",
    "indexer_loss_coeff": "indexer_params() -> IndexerParams(topk, heads, loss_coeff)",
    "sink": "attention_params() -> AttentionParams(scale, sink)",
    "scale": "attention_params() -> AttentionParams(scale, sink)",
    "model_attention": "attention(request, state)",
    "attend": "AttentionParams(kind='latent' or 'own') from attention_params()",
    "hidden_size": "check_inputs(inputs, checks)",
    "check_tensors": "check_inputs(inputs, checks)",
    "problems": "check_inputs(inputs, checks)",
    "checked_objects": "value_checks (the tensors it is handed are compared)",
    "record_indexer_loss": "module.indexer_loss (hp_cp sets it)",
}
"""0.3.0's model-math names -> the 0.4 hook that replaces each. A subclass that defines one
gets a ``DeprecationWarning`` naming the new hook, and runs as before (until 0.5.0)."""


def _adopt_0_3(cls: type) -> None:
    """Warn about and translate the 0.3.0 names ``cls`` defines (:data:`RENAMED_0_3`)."""
    own = vars(cls)
    if any(name in own for name in MACHINERY):
        return  # refused by _check_names
    four = {n for n in ("compress", "compress_index_keys") if n in own}
    four = {n for n in four if len(inspect.signature(own[n]).parameters) == 4}  # 0.4's already
    old = {name: own[name] for name in RENAMED_0_3 if name in own and name not in four}
    if not old:
        return
    for name in old:
        warnings.warn(
            f"{cls.__module__}.{cls.__qualname__}.{name} is the hp_cp 0.3 model-adapter API, "
            f"deprecated since 0.4.0 and removed in 0.5.0; use {RENAMED_0_3[name]} instead.",
            DeprecationWarning,
            stacklevel=4,
        )
    traits = {n: own[n] for n in ("state_class", "sequence_dim", "packed_topk_row") if n in old}
    if old.keys() & {"detach_indexer_inputs", "index_keys_without_grad"}:
        no_grad = getattr(cls, "index_keys_without_grad", False)
        detach = getattr(cls, "detach_indexer_inputs", True)
        traits["indexer_grad"] = "none" if no_grad else ("loss" if detach else "full")
    if traits:
        cls.traits = dataclasses.replace(cls.traits, **traits)
    for hook in [n for n in vars(_Hooks03) if not n.startswith("_")]:  # a 0.3 name stands
        stands = any(RENAMED_0_3[n].startswith(f"{hook}(") for n in old)  # for it: ours runs
        if stands and (hook not in own or hook in old):
            setattr(cls, hook, vars(_Hooks03)[hook])
    cls._v03 = {**getattr(cls, "_v03", {}), **old}


class _Hooks03:
    """The 0.4 hooks of an adapter written against 0.3.0, each calling its 0.3 methods."""

    def compress(self, rows: Any, start: int, state: Any) -> Any:
        return self._v03["compress"](self, rows, start)

    def compress_index_keys(self, rows: Any, start: int, state: Any) -> Any:
        return self._v03["compress_index_keys"](self, rows, start)

    def indexer_loss_scores(self, state: Any, keys: Any, selected: Any) -> Any:
        return self.index_scores_at(state, keys, selected)

    def indexer_params(self) -> IndexerParams:
        heads = self.index_heads() if hasattr(self, "index_heads") else 1
        coeff = self.indexer_loss_coeff() if hasattr(self, "indexer_loss_coeff") else None
        return IndexerParams(int(self.index_topk()), int(heads), coeff)

    def attention_params(self) -> AttentionParams:
        return AttentionParams(self.scale(), self.sink())

    def attention(self, request: Any, state: Any) -> Any:
        return self.model_attention(request, state)

    def check_inputs(self, inputs: Any, checks: TensorChecks) -> None:
        if hasattr(self, "check_tensors"):
            found = self.check_tensors(inputs, SimpleNamespace(device=checks.device))
            checks.problems += found.problems
            checks._sig += found._sig
        else:
            width = self.hidden_size() if hasattr(self, "hidden_size") else None
            checks.layer_input(self.module, inputs, width)
        for message in self.problems(inputs) if hasattr(self, "problems") else ():
            checks.fail(message)
