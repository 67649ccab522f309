"""The model-adapter spec: the hooks a model fills to run under CP, each optional with a default.

A model adapter is a subclass of :class:`ModelAdapter` registered under the entry-point group
``hp_cp.torch_models`` (:mod:`hp_cp_torch.model_registry`); ``hp_cp_core.enable_cp(model,
mesh)`` then finds every module of a claimed class, builds one adapter per layer at install
(kept on the layer until ``disable_cp``) and replaces the layer's forward. As pluggy separates
a hookspec from the ``PluginManager`` that calls it, this module is the spec and
:mod:`hp_cp_torch.runner` the machinery: the runner calls these hooks, and a subclass cannot
override the runner's steps (they are not here to override; naming one raises at class
definition). ``docs/writing-a-model-adapter.md`` holds the table of the hooks, generated from
their docstrings (``tests/torch/test_model_spec.py``).

Every hook runs on the rank's *local* rows, batch-major (``[B, L, ...]``); packed documents
come as one row (``B = 1``) whose positions restart at 0 per document. One forward's values
travel in a typed :class:`ForwardState` (its :attr:`ForwardState.inputs` is what
:meth:`ModelAdapter.read_inputs` returned: the one path of per-call values, such as a rotary
table the model passes its layer).

An adapter written against 0.3.0's ``ModelAdapter`` keeps working through 0.4: each 0.3 name
it defines warns (a ``DeprecationWarning`` naming the hook that replaces it) and runs as that
hook (:data:`RENAMED_0_3`).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn

from hp_cp_core import HpCpError, LayerSpec
from hp_cp_torch.indexer_loss import indexer_scores_at
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.validation import TensorChecks

__all__ = [
    "RECORDED",
    "AttentionParams",
    "ForwardState",
    "IndexerParams",
    "Latent",
    "LayerInputs",
    "ModelAdapter",
    "Projection",
    "Traits",
]

RECORDED: Any = SimpleNamespace(name="RECORDED")
"""``LayerInputs(cu_seqlens=RECORDED)``: the packed boundaries the batch recorded
(``handle.batch`` / ``cp_nemo_batch``), for a model that hands its layers per-row document
ids instead of boundaries. hp_cp puts them in before the checks (``None`` when none were
recorded for this sequence)."""


@dataclass
class LayerInputs:
    """A layer forward's arguments, as :meth:`ModelAdapter.read_inputs` reads them.

    Subclass it for the model's own arguments (a rotary table, a mask, a cache); every hook
    reads them as ``state.inputs``.

    Attributes:
        hidden: the local rows ``[B, L, hidden]`` (padded) or ``[L, hidden]`` /
            ``[1, L, hidden]`` with ``cu_seqlens`` (packed), batch-major whatever the
            model's :attr:`Traits.sequence_dim` (hp_cp transposes).
        position_ids: the rows' positions (``[L]`` or ``[B, L]``; packed: restarting per
            document), or ``None`` to take the plan's.
        cu_seqlens: the global document boundaries ``[0, ..., S]`` (packed), :data:`RECORDED`,
            else ``None``.
        loss_mask: rows that count in the indexer loss (``[L]`` or ``[B, L]``), or ``None``.
        real_rows: set by hp_cp: the global rows before the padding the layout added
            (``handle.batch``, ``handle.shard(..., pad_value=)``), ``None`` when none.
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
        query: ``[B, L, H, D]``, roped as the model ropes them (latent attention: ``D`` is
            ``nope + rope``).
        kv: the shared KV head ``[B, L, D]`` (keys and values are one row), roped; latent
            attention: each row's latent ``[c ; k_rot]``.
        index_input: what :meth:`ModelAdapter.index_queries` needs beyond the state (e.g. the
            query's low-rank residual), or ``None``.
        index_keys: with :attr:`Traits.rows_are_slots`, each row's indexer key ``[B, L, D_I]``
            (its own slot of the indexer).
        local_work: work that needs no received row, run while the exchanges travel (Note
            [Overlapped exchanges] in :mod:`hp_cp_core.collectives`): the first callable
            during the halo exchange, the rest during the slot exchange. With it ``query``
            may be ``None`` here, set on ``state.projection`` by the work.
    """

    query: torch.Tensor | None
    kv: torch.Tensor
    index_input: Any = None
    index_keys: torch.Tensor | None = None
    local_work: tuple[Callable[[], None], ...] = ()


@dataclass
class ForwardState:
    """One layer's CP forward, handed to the hooks; a model adds fields by subclassing it
    (``@dataclass(kw_only=True)``) and naming the subclass in :attr:`Traits.state_class`.

    Attributes:
        inputs: the forward's :class:`LayerInputs` (:meth:`ModelAdapter.read_inputs`).
        hidden: the local rows, batch-major ``[B, L, hidden]``.
        positions: ``[B, L]`` positions of the local rows (packed: per document).
        projection: the layer's :class:`Projection` (set before the exchanges).
        loss_mask: ``[B, L]`` bool rows that count in the indexer loss, or ``None`` (all).
        index_queries: what :meth:`ModelAdapter.index_queries` returned.
        plan: this rank's plan (:class:`hp_cp_core.plan.RankPlan`).
        slots: the gathered compressed slots ``[B, N, D]`` in global slot order (the layer's
            own, or those of the layer it shares them with), or ``None``.
        keys: the gathered indexer keys ``[B, N, D_I]``, or ``None``.
        selected: the picks this forward attends to (``[B, L, k]`` global slot ids, ``-1``
            none), or ``None`` (no indexer).
        candidates: the candidate blocks this layer selects among (``[B, L, N]`` bool: handed
            from the layer that publishes them, or set by
            :meth:`ModelAdapter.block_candidates` on the layer that makes them), or ``None``.
    """

    inputs: LayerInputs
    hidden: torch.Tensor
    positions: torch.Tensor
    projection: Projection | None = None
    loss_mask: torch.Tensor | None = None
    index_queries: Any = None
    plan: Any = None
    slots: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    selected: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


@dataclass(frozen=True)
class Traits:
    """What a model declares once, as data (``traits = Traits(...)`` on the adapter class).

    Attributes:
        state_class: the :class:`ForwardState` (sub)class one forward's values travel in.
        sequence_dim: the dimension of the layer's hidden rows that runs along the sequence: 1
            for batch-major ``[B, L, hidden]``, 0 for sequence-major ``[L, B, hidden]``
            (Megatron's). The hooks see batch-major rows either way and the layer returns
            its output in the model's layout; the rows it sees along this dimension are
            checked against the sequence ``handle.shard`` / ``handle.batch`` cut.
        packed_topk_row: how the model on one process picks its indexer top-k (Note [The
            one-process top-k row] in :mod:`hp_cp_core.columns`): ``"document"`` (each
            document's own row), ``"stream"`` (one row for the packed stream), or ``None``:
            hp_cp's device-independent top-k (lower slot id first on ties).
        ascending_picks: the picks in ascending slot order (a model that calls
            ``torch.topk(..., sorted=False)`` and sorts), else in descending-score order.
        indexer_grad: what the indexer's compressor learns from: ``"loss"`` (its input rows
            detached: the indexer loss only, as Megatron), ``"none"`` (run without autograd:
            an indexer that only feeds integer picks, HF's and NeMo's) or ``"full"``
            (gradients reach the layer's input through the keys).
        rows_are_slots: the projection's rows are the slots (DSA, ratio 1): ``Projection.kv``
            the main slots and ``Projection.index_keys`` the indexer's, no compressor.
    """

    state_class: type[ForwardState] = ForwardState
    sequence_dim: int = 1
    packed_topk_row: str | None = None
    ascending_picks: bool = False
    indexer_grad: str = "loss"
    rows_are_slots: bool = False


@dataclass(frozen=True)
class IndexerParams:
    """The layer's indexer (:meth:`ModelAdapter.indexer_params`).

    Attributes:
        topk: the slots it keeps per query.
        heads: the heads :meth:`ModelAdapter.index_scores` scores before summing them (it
            bounds each score chunk's ``[rows, heads, slots]`` intermediate).
        loss_coeff: the indexer loss's weight in the output's gradient, or ``None``: no loss.
            The loss (KL of the attention's weights at the picks to the indexer's softmax, a
            mean over the rows that count, the same on every rank) is attached to the layer
            output, and its value is kept as ``module.indexer_loss``: a model that adds
            ``layer.indexer_loss`` to its own loss counts it twice.
    """

    topk: int
    heads: int = 1
    loss_coeff: float | None = None


@dataclass(frozen=True)
class Latent:
    """Latent (MLA) attention: keys and values are each row's latent ``[c ; k_rot]`` through
    ``up_proj`` (Note [DSA attention on the latents] in :mod:`hp_cp_torch.latent_attention`).

    Attributes:
        nope: ``qk_nope_head_dim``; rope: ``qk_rope_head_dim``; value: ``v_head_dim``;
        rank: ``kv_lora_rank``.
        up_proj: ``kv_b_proj.weight`` ``[H * (nope + value), rank]``.
    """

    nope: int
    rope: int
    value: int
    rank: int
    up_proj: torch.Tensor


ATTENTION_KINDS = ("shared_kv", "latent", "own")


@dataclass(frozen=True)
class AttentionParams:
    """The layer's attention (:meth:`ModelAdapter.attention_params`).

    Attributes:
        scale: the softmax scale.
        sink: per-head sink logits ``[H]`` (inside the softmax's max and denominator), or
            ``None``.
        kind: ``"shared_kv"`` (the family's attention over one shared KV head, by the
            configured kernel), ``"latent"`` (MLA, with :attr:`latent`) or ``"own"`` (the
            model's :meth:`ModelAdapter.attention` always, whatever the kernel: it picks its
            slots itself from ``state.keys``; hp_cp runs no selection).
        latent: the dims of ``kind="latent"``.
    """

    scale: float | None = None
    sink: torch.Tensor | None = None
    kind: str = "shared_kv"
    latent: Latent | None = None


def _required(adapter: Any, hook: str, why: str) -> HpCpError:
    return HpCpError(
        f"{type(adapter).__qualname__} does not define the hook {hook} that {why} needs "
        "(docs/writing-a-model-adapter.md, the table of hooks)."
    )


class ModelAdapter:
    """The spec of a model adapter: subclass it and define the hooks your model needs.

    Attributes:
        claims: qualified names of the modeling classes this adapter runs
            (``"package.module.Class"``), read when the entry point's name is not itself a
            class name.
        traits: the model's :class:`Traits` (default ``Traits()``).

    Args:
        module: the layer this adapter drives (one adapter per layer, built at install).
    """

    claims: ClassVar[tuple[str, ...]] = ()
    traits: ClassVar[Traits] = Traits()

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _adopt_0_3(cls)

    @classmethod
    def prepare_model(cls, model: nn.Module, layers: list[nn.Module], handle: Any) -> None:
        """Model-level work under CP (guards, pre-hooks, another module's forward), once per
        adapter class and ``enable_cp``, with that class's layers.

        Called: in ``enable_cp`` before any layer is installed; undo through
        ``handle.on_disable(fn)``.
        Default: nothing.
        """

    def layer_spec(self) -> LayerSpec:
        """The layer's ``LayerSpec(compress_ratio, window_size, has_indexer, ...)``.

        Called: when ``enable_cp`` plans the layers, then by the core; it never depends on
        the input.
        Default: none (required).
        """
        raise _required(self, "layer_spec()", "every layer")

    def layer_name(self) -> str:
        """How error messages name the layer (``"<name> under CP: ..."``).

        Called: when a message is made.
        Default: the layer's class name.
        """
        return type(self.module).__name__

    def read_inputs(
        self,
        hidden_states: Any,
        position_ids: Any = None,
        cu_seqlens: Any = None,
        loss_mask: Any = None,
    ) -> LayerInputs:
        """The layer's forward arguments, as the model calls the layer, into a
        :class:`LayerInputs` (subclass it for the model's own; a missing value is ``None``).

        Called: first in every CP forward, with exactly the layer's arguments.
        Default: ``forward(hidden_states, position_ids=None, cu_seqlens=None, loss_mask=None)``.
        """
        return LayerInputs(hidden_states, position_ids, cu_seqlens, loss_mask)

    def check_inputs(self, inputs: LayerInputs, checks: TensorChecks) -> None:
        """Record what CP cannot run in this call: ``checks.fail(message)`` (a bad shape, a
        cache, dropout in training, a framework's own CP), with the fix; the layer's name is
        prepended. Recorded, never raised: every rank raises them together.

        Called: every forward, before any exchange.
        Default: ``checks.layer_input(module, inputs)``: ``x [B, L, hidden]`` (``[L, hidden]``
        packed) of the parameters' dtype and device, ``module.config.hidden_size`` wide,
        per-row ``position_ids`` / ``loss_mask``.
        """
        checks.layer_input(self.module, inputs)

    def value_checks(self, inputs: LayerInputs, plan: Any) -> list[tuple[Any, str]]:
        """Checks that read tensor values, as ``(flag, message)`` (a 0-dim bool tensor on the
        device, or a bool; ``True`` fails): e.g. position ids against ``plan.positions`` (a
        numpy array ``[L]``). The flags ride on the agreement's one gather (no host read of
        their own); a later layer of the same forward handed the very same tensors (every
        tensor field of its inputs but ``hidden``) skips them.

        Called: every forward, once the plan exists.
        Default: none.
        """
        return []

    def project(self, state: ForwardState) -> Projection:
        """The queries and shared KV rows of ``state.hidden`` at ``state.positions``, by the
        model's own ops (they run unchanged on local rows).

        Called: once per forward, before any exchange, with autograd.
        Default: none (required).
        """
        raise _required(self, "project(state)", "every layer")

    def compress(self, rows: torch.Tensor, start: int, state: ForwardState) -> torch.Tensor:
        """The main compressor: slots ``[B, n // r, D]`` of one document's rows ``rows [B, n,
        hidden]`` starting on a block boundary (one block early for r = 4's overlap: that slot
        is dropped), slot ``j`` at document position ``start + j*r``. ``state`` carries the
        forward's values (``state.inputs``: a rotary table the model passed).

        Called: per document segment of the rank (r > 0; ``n`` may be 0: return
        ``[B, 0, D]`` with the parameters in the graph).
        Default: none (required for r > 0, unless ``traits.rows_are_slots``).
        """
        raise _required(self, "compress(rows, start, state)", "a layer with r > 0")

    def compress_index_keys(
        self, rows: torch.Tensor, start: int, state: ForwardState
    ) -> torch.Tensor:
        """The indexer's compressor, as :meth:`compress`: keys ``[B, n // r, D_I]`` (rows
        detached or without autograd as ``traits.indexer_grad`` says).

        Called: as ``compress``, for a layer whose ``LayerSpec`` has an indexer.
        Default: none (required with an indexer, unless ``traits.rows_are_slots``).
        """
        raise _required(self, "compress_index_keys(rows, start, state)", "an indexer")

    def index_queries(self, state: ForwardState) -> Any:
        """What :meth:`index_scores` scores with (e.g. the indexer's roped queries and
        per-head weights), from ``state.hidden``, ``state.positions`` and
        ``state.projection.index_input``; kept as ``state.index_queries``.

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
        Default: none (required for a layer that selects).
        """
        raise _required(self, "index_scores(state, lo, hi, keys)", "a layer that selects")

    def indexer_loss_scores(
        self, state: ForwardState, keys: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """The indexer loss's student: each local query's scores ``[B, L, k]`` at its own
        picks ``selected`` (global slot ids into ``keys [B, N, D_I]``, ``-1``: any value),
        with autograd, as :meth:`index_scores` scores them.

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

    def block_candidates(
        self, state: ForwardState, scores: torch.Tensor, lo: int, hi: int, row: Any
    ) -> torch.Tensor:
        """Candidate-block selection (DeepSeek V4.1's two-level indexer): the one-process
        score rows ``scores [B, hi - lo, row.length]`` (fp32, ``-inf`` where invisible) of
        local queries ``lo:hi`` (``row.start``: the row's first slot), returned with what they
        may not pick masked ``-inf``; the layer that makes the candidates sets
        ``state.candidates`` (published to the layers that reuse them), the others read it.

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
        Default: none (required).
        """
        raise _required(self, "attention_params()", "every layer")

    def attention(self, request: AttentionRequest, state: ForwardState) -> torch.Tensor | None:
        """The model's own attention op order, in the model's dtype, on the plan's columns:
        ``[B, L, H, D]``, or ``None``: it has none (the configured kernel runs).

        Called: for ``attention_kernel="model_ops"`` / ``attention_precision="model"``, and
        every forward of ``kind="own"``.
        Default: ``None``.
        """
        return None

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """The layer output ``[B, L, ...]`` from the attention's ``o [B, L, H, D]`` (inverse
        RoPE, output projection...).

        Called: after the attention.
        Default: none (required).
        """
        raise _required(self, "output(o, state)", "every layer")

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

    class Refusal(ModelAdapter):
        def __init__(self, module: nn.Module) -> None:
            raise HpCpError(message)

    return Refusal


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
    "attend": "attention_params() -> AttentionParams(kind='latent' or 'own')",
    "hidden_size": "check_inputs(inputs, checks)",
    "check_tensors": "check_inputs(inputs, checks)",
    "problems": "check_inputs(inputs, checks)",
    "checked_objects": "value_checks (the tensors it is handed are compared)",
    "record_indexer_loss": "module.indexer_loss (hp_cp sets it)",
}
"""0.3.0's model-math names -> the 0.4 hook that replaces each. A subclass that defines one
gets a ``DeprecationWarning`` naming the new hook, and runs as before (until 0.5.0)."""

MACHINERY_0_3 = (
    "make_forward begin agree_inputs selection select compress_main compress_indexer "
    "run_attention extract_ori_kv state"
).split()
"""0.3.0's machinery methods: :mod:`hp_cp_torch.runner`'s now, which no model overrides."""


def _adopt_0_3(cls: type) -> None:
    """Warn about and translate the 0.3.0 names ``cls`` defines (:data:`RENAMED_0_3`); refuse
    an override of the machinery."""
    own = vars(cls)
    machinery = [name for name in MACHINERY_0_3 if name in own]
    if machinery:
        raise HpCpError(
            f"{cls.__qualname__} defines {machinery}: hp_cp's machinery (hp_cp_torch.runner), "
            "which a model adapter cannot override since 0.4.0. Fill the hooks of "
            "hp_cp_torch.model_adapter.ModelAdapter instead (docs/writing-a-model-adapter.md)."
        )
    old = {name: own[name] for name in RENAMED_0_3 if name in own}
    if "compress" in old and len(inspect.signature(old["compress"]).parameters) == 4:
        del old["compress"]  # compress(self, rows, start, state): the 0.4 signature
    if "compress_index_keys" in old:
        if len(inspect.signature(old["compress_index_keys"]).parameters) == 4:
            del old["compress_index_keys"]
    if not old:
        return
    for name in old:
        warnings.warn(
            f"{cls.__module__}.{cls.__qualname__}.{name} is the hp_cp 0.3 model-adapter API, "
            f"deprecated since 0.4.0 and removed in 0.5.0; use {RENAMED_0_3[name]} instead.",
            DeprecationWarning,
            stacklevel=4,
        )
    fields = {n: own[n] for n in ("state_class", "sequence_dim", "packed_topk_row") if n in old}
    detach = own.get("detach_indexer_inputs", getattr(cls, "detach_indexer_inputs", True))
    if "index_keys_without_grad" in old or "detach_indexer_inputs" in old:
        no_grad = own.get("index_keys_without_grad", getattr(cls, "index_keys_without_grad", 0))
        fields["indexer_grad"] = "none" if no_grad else ("loss" if detach else "full")
    if fields:
        cls.traits = dataclasses.replace(cls.traits, **fields)
    hooks = _hooks_0_3(cls, old)
    for name, hook in hooks.items():
        if name not in own or name in old:  # compress(rows, start): the same name, replaced
            setattr(cls, name, hook)
    cls._v03 = {**getattr(cls, "_v03", {}), **old}


def _hooks_0_3(cls: type, old: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """The 0.4 hooks of a 0.3 adapter class, each calling its 0.3 methods."""
    hooks: dict[str, Callable[..., Any]] = {}
    for name in ("compress", "compress_index_keys"):
        if name in old:
            fn = old[name]
            hooks[name] = lambda self, rows, start, state, fn=fn: fn(self, rows, start)
    if "index_scores_at" in old:
        hooks["indexer_loss_scores"] = old["index_scores_at"]
    if old.keys() & {"index_topk", "index_heads", "indexer_loss_coeff"}:

        def indexer_params(self: Any) -> IndexerParams | None:
            coeff = getattr(self, "indexer_loss_coeff", lambda: None)()
            topk = getattr(self, "index_topk", None)
            if topk is None:
                return None if coeff is None else IndexerParams(0, loss_coeff=coeff)
            heads = getattr(self, "index_heads", lambda: 1)()
            return IndexerParams(int(topk()), int(heads), coeff)

        hooks["indexer_params"] = indexer_params
    if old.keys() & {"sink", "scale"}:
        hooks["attention_params"] = lambda self: AttentionParams(self.scale(), self.sink())
    if "model_attention" in old:
        hooks["attention"] = old["model_attention"]
    if old.keys() & {"hidden_size", "check_tensors", "problems"}:

        def check_inputs(self: Any, inputs: Any, checks: TensorChecks) -> None:
            tensors = getattr(self, "check_tensors", None)
            if tensors is not None:
                found = tensors(inputs, SimpleNamespace(device=checks.device))
                checks.problems += found.problems
                checks._sig += found._sig
            else:
                width = getattr(self, "hidden_size", lambda: None)()
                checks.layer_input(self.module, inputs, width)
            for message in getattr(self, "problems", lambda inputs: [])(inputs):
                checks.fail(message)

        hooks["check_inputs"] = check_inputs
    return hooks
