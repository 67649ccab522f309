"""User options (:class:`CPConfig`) and the per-call context handed to every stage
hook (:class:`CPContext`). The layer description :class:`LayerSpec` lives in
:mod:`hp_cp_core.spec` (so that :mod:`hp_cp_core.plan` needs nothing from this module) and is
importable from here too."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hp_cp_core.errors import HpCpError
from hp_cp_core.spec import ARTIFACTS, GRIDS, LayerSpec

if TYPE_CHECKING:
    from hp_cp_core.plan import RankPlan

__all__ = [
    "ARTIFACTS",
    "GRIDS",
    "LAYOUTS",
    "CPConfig",
    "CPContext",
    "PRECISIONS",
    "DeepSeekV4CPConfig",
    "DeepSeekV4CPContext",
    "LayerSpec",
]

LAYOUTS = ("contiguous", "load_balanced")
PRECISIONS = ("fp32", "model")


@dataclass(frozen=True)
class CPConfig:
    """Options of one ``enable_cp`` call.

    Attributes:
        layout: ``"contiguous"`` (rank k holds rows ``[k*L, (k+1)*L)``) or ``"load_balanced"``
            (rank k holds chunks k and 2cp-1-k of 2cp equal chunks, so causal work is even).
        attention_kernel: the name of an attention kernel the backend registers; the core
            does not know the names, the backend checks the name when ``enable_cp`` installs
            the layers (an ``HpCpError`` listing its kernels). The torch backend ships
            ``"banded"`` (the default: the window, and HCA's visible slots, as dense masked
            bands, only the indexer's top-k gathered, recomputed in backward), ``"smallop"``
            (gather the selected rows; the exact reference), ``"efficient"`` (memory flat in
            the number of selected keys), ``"triton"`` (fused GPU kernels, with
            ``hp-cp-torch[triton]``) and ``"model_ops"`` (the model's own op order), and takes
            third parties' (:mod:`hp_cp_torch.kernels.registry`). Backends that have only one
            ignore the name.
        query_chunk: queries scored / attended per chunk by causal-aware kernels.
        check_inputs_across_ranks: all-gather a few integers (each rank's check verdict and
            digests of its rows, cu_seqlens, tensor shapes, layer spec and these options)
            before the first exchange, so that a bad input on one rank, or ranks given
            inconsistent inputs, make every rank raise ``HpCpError`` instead of hanging. See
            Note [Validate, agree, then communicate] in :mod:`hp_cp_core.validation`. Must be
            the same on every rank: it is the one option the agreement cannot check (ranks
            that differ on it run different collectives; gloo then aborts or waits).
        plan_cache_size: most plans kept per ``enable_cp`` handle (least recently used
            goes first). A plan holds O(L) index arrays per input shape (per ``cu_seqlens``
            when packed), so this bounds the cache's memory when every batch differs.
        single_rank_bypass: with a CP group of one, keep each layer's original forward
            (the default: nothing to exchange). ``False`` runs the full CP path on a group of
            one (plan, agreement, exchanges): what tests and benchmarks of the CP path use.
        desync_report: when a CP collective fails or times out, publish this rank's record
            of the collectives it entered (kept in memory, a bounded ring) to a store its
            peers can read, and read theirs, so the error names where every rank is (the
            torch backend: no store traffic while all goes well). ``False`` keeps only this
            rank's own record and never touches the store.
        overlap_exchanges: issue each halo and slot exchange as soon as its inputs exist and
            wait for it only where its output is first used, with the layer's local work in
            between (query projections, indexer queries); backward mirrors it (Note
            [Overlapped exchanges] in :mod:`hp_cp_core.collectives`). ``False``: every
            exchange is issued and waited in place (the blocking path). Same results either
            way; backends without split exchanges always block.
        regather_compressed_kv: do not keep the global compressed KV and indexer keys
            (every earlier rank's slots, ``S / r`` rows) alive for backward: the layer's
            backward receives them again, in one more slot exchange at its start, so what a
            rank keeps for backward grows with its own rows only (Note [Re-gathered slots] in
            :mod:`hp_cp_core.compression`). Same results, bit for bit. Backends whose group
            has no ``regather_scope`` keep the slots (the option changes nothing there). Must
            be the same on every rank.
        attention_precision: ``"fp32"`` (the default): the attention kernel computes its
            logits, softmax and weighted sum in fp32 whatever the inputs' dtype (every hp_cp
            kernel does; bf16 inputs are upcast, the output cast back), which in bf16 is at
            least as close to the fp32 model as the model's own eager ops. ``"model"``: the
            model's own op sequence in the model's dtype (transformers' eager attention: bf16
            logits and probabilities in a bf16 model), for a run that must round as the model
            does on one device; integrations without that path raise ``HpCpError`` at
            ``enable_cp``. See ``docs/semantics.md`` (bf16). Must be the same on every rank.
    """

    layout: str = "contiguous"
    attention_kernel: str = "banded"
    query_chunk: int = 1024
    check_inputs_across_ranks: bool = True
    plan_cache_size: int = 64
    single_rank_bypass: bool = True
    desync_report: bool = True
    overlap_exchanges: bool = True
    regather_compressed_kv: bool = False
    attention_precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise HpCpError(
                f"CPConfig.layout={self.layout!r} is not a layout; expected one of {LAYOUTS}."
            )
        if not isinstance(self.attention_kernel, str) or not self.attention_kernel:
            raise HpCpError(
                f"CPConfig.attention_kernel={self.attention_kernel!r} is not a kernel "
                "name; pass the name of a kernel the backend registers (a non-empty string)."
            )
        if self.attention_precision not in PRECISIONS:
            raise HpCpError(
                f"CPConfig.attention_precision={self.attention_precision!r} is not a "
                f"precision; expected one of {PRECISIONS}."
            )
        if int(self.query_chunk) < 1:
            raise HpCpError(f"CPConfig.query_chunk must be >= 1, got {self.query_chunk}.")
        if int(self.plan_cache_size) < 1:
            raise HpCpError(f"CPConfig.plan_cache_size must be >= 1, got {self.plan_cache_size}.")


@dataclass(frozen=True)
class CPContext:
    """Everything a stage hook needs for one CP forward, and nothing it must recompute.

    Attributes:
        cp_rank: this rank in the CP group.
        cp_size: the CP group size.
        spec: the layer's :class:`LayerSpec`.
        plan: this rank's :class:`~hp_cp_core.plan.RankPlan` (cached index arrays).
        config: the :class:`CPConfig` of the ``enable_cp`` call.
        cu_seqlens: global packed document boundaries (numpy), ``None`` when padded.
        slots: the gathered main compressed KV ``[n, (batch,) D]`` in global slot order,
            slots ``0 .. plan.n_needed_slots - 1``; ``None`` before the gather or when r = 0.
            0.4's name ``cmp_kv_global`` stays as an alias (read, construct, ``replace``).
        keys: the gathered indexer keys, same rows as ``slots``; ``None`` when absent. 0.4's
            name ``cmp_idx_global`` stays as an alias.
        ops: the module's :class:`~hp_cp_core.backend.Backend` (tensor ops for core helpers).
        extra: backend-private values the install wrapper passes to its own hooks.
        group: the CP :class:`~hp_cp_core.backend.Group` (for
            :func:`hp_cp_core.indexer_loss.global_indexer_loss`).
        loss_rows: rows (batch x tokens) of *all* ranks that count in the indexer loss's
            mean; see Note [Indexer loss under CP] in :mod:`hp_cp_core.indexer_loss`.
        sequence_rows: global rows of the sequence before the padding
            ``handle.shard(..., pad_value=...)`` appended to it, when this forward runs on
            that padded sequence; ``None`` when every row is real. See
            :meth:`hp_cp_core.columns.PlanColumns.topk_rows`.
        roles: this layer's :class:`~hp_cp_core.sharing.LayerRoles` (what it makes, reuses
            and publishes); ``None`` for a layer planned alone.
        reused: the artifacts this layer received from the layers that made them (keys of
            :data:`ARTIFACTS` in ``spec.reuses``): ``"selection"`` is the owner's per-query
            top-k (whatever the owner's backend published: global slot ids, ``-1`` = none);
            the gathered slots are already in ``slots`` / ``keys``.
        outputs: where ``hp_cp_run_attention`` puts what this layer publishes for later
            layers: ``outputs["selection"]`` when ``roles.publishes("selection")`` (the
            core checks it is there and hands it on, with no collective).
    """

    cp_rank: int
    cp_size: int
    spec: LayerSpec
    plan: RankPlan
    config: CPConfig
    cu_seqlens: np.ndarray | None = None
    slots: Any = None
    keys: Any = None
    ops: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    group: Any = None
    loss_rows: int = 0
    sequence_rows: int | None = None
    roles: Any = None
    reused: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def cmp_kv_global(self) -> Any:
        """0.4's name of :attr:`slots` (backend API 0.2), kept as an alias."""
        return self.slots

    @property
    def cmp_idx_global(self) -> Any:
        """0.4's name of :attr:`keys` (backend API 0.2), kept as an alias."""
        return self.keys

    @property
    def pos_offset(self) -> int:
        """Global row of local row 0."""
        return int(self.plan.local_rows[0]) if len(self.plan.local_rows) else 0

    @property
    def ori_halo_len(self) -> int:
        """Halo rows at the front of ``ori_ext`` (for a contiguous layout: all of them)."""
        return int(self.plan.window.n_halo)

    @property
    def positions(self) -> np.ndarray:
        """Position of each local row (document-relative when packed on a per-document grid)."""
        return self.plan.positions

    def replace(self, **changes: Any) -> CPContext:
        """A copy with some fields changed (the context is frozen)."""
        return dataclasses.replace(self, **changes)


CONTEXT_ALIASES = {"cmp_kv_global": "slots", "cmp_idx_global": "keys"}
"""0.4's :class:`CPContext` field names -> the one word each (docs/api.md, "One word per
concept"): accepted by the constructor and ``replace``, readable as properties."""

_dataclass_init = CPContext.__init__


@functools.wraps(_dataclass_init)
def _init_accepting_aliases(self: CPContext, *args: Any, **kwargs: Any) -> None:
    for old, new in CONTEXT_ALIASES.items():  # 0.4's field names (backend API 0.2)
        if old in kwargs:
            kwargs[new] = kwargs.pop(old)
    _dataclass_init(self, *args, **kwargs)


CPContext.__init__ = _init_accepting_aliases  # type: ignore[method-assign]

# The 0.2 names, kept as plain aliases: the config and context serve the whole family (V4,
# V4.1, V3.2, GLM-5), not only DeepSeek V4.
DeepSeekV4CPConfig = CPConfig
DeepSeekV4CPContext = CPContext
