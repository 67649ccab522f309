"""User options (:class:`DeepSeekV4CPConfig`), layer description (:class:`LayerSpec`) and the
per-call context handed to every stage hook (:class:`DeepSeekV4CPContext`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hp_cp_core.errors import HpCpError

if TYPE_CHECKING:
    from hp_cp_core.plan import RankPlan

LAYOUTS = ("contiguous", "load_balanced")
GRIDS = ("per_document", "global")
KERNELS = ("smallop", "efficient", "triton", "banded")


@dataclass(frozen=True)
class DeepSeekV4CPConfig:
    """Options of one ``enable_cp`` call.

    Attributes:
        layout: ``"contiguous"`` (rank k holds rows ``[k*L, (k+1)*L)``) or ``"load_balanced"``
            (rank k holds chunks k and 2cp-1-k of 2cp equal chunks, so causal work is even).
        attention_kernel: ``"banded"`` (the default: the window, and HCA's visible slots, as
            dense masked bands, only the indexer's top-k gathered, recomputed in backward),
            ``"smallop"`` (gather the selected rows; the exact reference), ``"efficient"``
            (gathered in chunks, recomputes in backward; memory does not grow with the number
            of selected keys) or ``"triton"`` (fused GPU kernels, torch backend with
            ``hp-cp-torch[triton]``). Backends that have only one ignore the others.
        query_chunk: queries scored / attended per chunk by causal-aware kernels.
        check_inputs_across_ranks: all-gather a few integers (each rank's check verdict and
            digests of its rows, cu_seqlens, tensor shapes, layer spec and these options)
            before the first exchange, so that a bad input on one rank, or ranks given
            inconsistent inputs, make every rank raise ``HpCpError`` instead of hanging. See
            Note [Validate, agree, then communicate] in :mod:`hp_cp_core.validation`. Must be
            the same on every rank.
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
    """

    layout: str = "contiguous"
    attention_kernel: str = "banded"
    query_chunk: int = 1024
    check_inputs_across_ranks: bool = True
    plan_cache_size: int = 64
    single_rank_bypass: bool = True
    desync_report: bool = True
    overlap_exchanges: bool = True

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise HpCpError(
                f"DeepSeekV4CPConfig.layout={self.layout!r} is not a layout; expected one of "
                f"{LAYOUTS}."
            )
        if self.attention_kernel not in KERNELS:
            raise HpCpError(
                f"DeepSeekV4CPConfig.attention_kernel={self.attention_kernel!r} is not a kernel; "
                f"expected one of {KERNELS}."
            )
        if int(self.query_chunk) < 1:
            raise HpCpError(f"DeepSeekV4CPConfig.query_chunk must be >= 1, got {self.query_chunk}.")
        if int(self.plan_cache_size) < 1:
            raise HpCpError(
                f"DeepSeekV4CPConfig.plan_cache_size must be >= 1, got {self.plan_cache_size}."
            )


ARTIFACTS = ("compressed_kv", "index_keys", "selection")
"""What a layer can reuse from an earlier one (``LayerSpec.reuses``); see Note [Layers that
share their indexer] in :mod:`hp_cp_core.sharing`."""


@dataclass(frozen=True, repr=False)
class LayerSpec:
    """What the core needs to know about one attention layer (from ``hp_cp_layer_spec``).

    The family it describes (Note [The sparse-attention family] in :mod:`hp_cp_core.sharing`):

    ======================  =====  ======  ===========  ======================================
    layer                   ratio  window  has_indexer  reuses
    ======================  =====  ======  ===========  ======================================
    V4 sliding window       0      128     False        ()
    V4 CSA / HCA            4/128  128     True/False   ()
    V3.2 / GLM-5 DSA        1      0       True         ()
    GLM-5 "shared" layer    1      0       True         ("selection",)
    V4.1 CSA2 Full          r      W       True         ()
    V4.1 CSA2 Reindex       r      W       True         ("compressed_kv", "index_keys")
    V4.1 CSA2 Reuse         r      W       True         ("compressed_kv", "index_keys",
                                                        "selection")
    ======================  =====  ======  ===========  ======================================

    Attributes:
        compress_ratio: 0 (sliding window only), 1 (no pooling: every token is its own
            slot, the "compressor" is the identity; DSA), or a ratio >= 2 such as 4 (CSA)
            or 128 (HCA). Slot j of ratio r covers rows ``[j*r, (j+1)*r)`` of its document
            and is visible to query t iff ``(j+1)*r <= t+1``: for r = 1 a token sees itself.
        window_size: W, keys ``t-W+1 .. t`` (the query itself included); 0 means no sliding
            window (DSA: the layer reads only its selected slots).
        has_indexer: the layer's attention reads an indexer top-k of its visible slots (its
            own indexer, or a selection it reuses). CSA's indexer has its own compressor; a
            ratio-1 indexer scores tokens.
        force_unfused: the module asked for the small-op (unfused) attention path.
        packed_grid: ``"per_document"`` (DeepSeek / Megatron: grid, RoPE and window restart
            at each document) or ``"global"`` (MindFormers: blocks on the global grid, valid
            only inside one document).
        index_block: two-level indexer: 0 (one level: top-k of the visible slots) or b >= 1:
            the indexer first scores candidate blocks of b consecutive slots of a document
            (block c of a document holds its slots ``c*b .. c*b + b - 1``; a query sees a
            block when it sees the block's first slot), keeps the best ones, then takes the
            top-k over the slots of the kept blocks
            (:meth:`hp_cp_core.columns.PlanColumns.block_visibility`,
            :func:`hp_cp_core.columns.select_two_level_numpy`). It moves nothing more: the
            block keys are computed from the gathered index keys, token-locally.
        reuses: what the layer receives from an earlier layer instead of computing it, a
            subset of :data:`ARTIFACTS`: ``"compressed_kv"`` (the gathered main compressed
            KV), ``"index_keys"`` (the gathered indexer keys), ``"selection"`` (the indexer
            top-k of each local query). A reused artifact costs no collective: the layer
            that made it gathered it once for the whole group of layers
            (:func:`hp_cp_core.sharing.plan_sharing` says which layer owns what).
        share_from: the index (among the layers ``enable_cp`` found, in order) of the layer
            whose artifacts this one reuses; ``None``: for each artifact, the nearest
            earlier layer that makes it.
    """

    compress_ratio: int
    window_size: int = 128
    has_indexer: bool = False
    force_unfused: bool = True
    packed_grid: str = "per_document"
    index_block: int = 0
    reuses: tuple[str, ...] = ()
    share_from: int | None = None

    def __post_init__(self) -> None:
        r = int(self.compress_ratio)
        if r < 0:
            raise HpCpError(
                f"LayerSpec.compress_ratio={self.compress_ratio!r}: expected 0 (sliding window), "
                "1 (no pooling: DSA) or a ratio >= 2 such as 4 (CSA) or 128 (HCA)."
            )
        if int(self.window_size) < 0 or (r == 0 and int(self.window_size) < 1):
            raise HpCpError(
                f"LayerSpec.window_size must be >= 1 (or 0, no window, for a layer with "
                f"compressed slots: compress_ratio >= 1), got {self.window_size} with "
                f"compress_ratio={self.compress_ratio}."
            )
        if self.packed_grid not in GRIDS:
            raise HpCpError(f"LayerSpec.packed_grid={self.packed_grid!r}: expected one of {GRIDS}.")
        if self.has_indexer and r == 0:
            raise HpCpError("LayerSpec.has_indexer=True needs compress_ratio > 0.")
        if r == 1 and int(self.window_size) == 0 and not self.has_indexer:
            raise HpCpError(
                "LayerSpec(compress_ratio=1, window_size=0) needs has_indexer=True: a layer "
                "without a window and without pooling attends only to its indexer's picks "
                "(DSA). A dense causal layer is not a sparse-attention layer hp_cp plans."
            )
        if not isinstance(self.reuses, tuple):
            object.__setattr__(self, "reuses", tuple(self.reuses))
        bad = [a for a in self.reuses if a not in ARTIFACTS]
        if bad or len(set(self.reuses)) != len(self.reuses):
            raise HpCpError(
                f"LayerSpec.reuses={self.reuses!r}: expected distinct names out of {ARTIFACTS}."
            )
        if self.reuses and r == 0:
            raise HpCpError(
                f"LayerSpec.reuses={self.reuses!r} needs compress_ratio > 0 (a sliding-window "
                "layer has nothing to share)."
            )
        if ("selection" in self.reuses or "index_keys" in self.reuses) and not self.has_indexer:
            raise HpCpError(
                f"LayerSpec.reuses={self.reuses!r} names the indexer's artifacts, so the layer "
                "reads an indexer selection: set has_indexer=True."
            )
        if int(self.index_block) < 0:
            raise HpCpError(f"LayerSpec.index_block must be >= 0, got {self.index_block}.")
        if int(self.index_block) and not self.has_indexer:
            raise HpCpError("LayerSpec.index_block > 0 (a two-level indexer) needs has_indexer.")
        if self.share_from is not None and (not self.reuses or int(self.share_from) < 0):
            raise HpCpError(
                f"LayerSpec.share_from={self.share_from!r} needs a non-empty reuses and a layer "
                "index >= 0."
            )

    def __repr__(self) -> str:
        # the family's fields only when set, so a V4 layer reads as it always did
        names = ["compress_ratio", "window_size", "has_indexer", "force_unfused", "packed_grid"]
        names += [
            n
            for n, default in (("index_block", 0), ("reuses", ()), ("share_from", None))
            if getattr(self, n) != default
        ]
        return f"LayerSpec({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    @property
    def overlap(self) -> bool:
        """Whether a slot also reads the previous block (the r = 4 compressor)."""
        return int(self.compress_ratio) == 4

    @property
    def makes_compressed_kv(self) -> bool:
        """The layer computes (and exchanges) its own main compressed KV."""
        return int(self.compress_ratio) > 0 and "compressed_kv" not in self.reuses

    @property
    def makes_index_keys(self) -> bool:
        """The layer computes (and exchanges) its own indexer keys: it has an indexer, does
        not reuse the keys, and needs them (it does not reuse the selection either)."""
        return (
            self.has_indexer and "index_keys" not in self.reuses and "selection" not in self.reuses
        )

    @property
    def makes_selection(self) -> bool:
        """The layer runs its own indexer top-k (over its own or reused index keys)."""
        return self.has_indexer and "selection" not in self.reuses

    @property
    def needs_halo(self) -> bool:
        """Whether the layer runs the halo exchange: it has a window (W >= 1; W = 1 reads no
        halo row but keeps the exchange, as a V4 layer always did), or a pooling compressor
        (r >= 2) of its own whose blocks may straddle ranks. ``False`` (DSA: r = 1, no
        window; a layer with no window reusing every slot) skips it on every rank."""
        pooled = int(self.compress_ratio) >= 2 and (
            self.makes_compressed_kv or self.makes_index_keys
        )
        return int(self.window_size) > 0 or pooled


@dataclass(frozen=True)
class DeepSeekV4CPContext:
    """Everything a stage hook needs for one CP forward, and nothing it must recompute.

    Attributes:
        cp_rank: this rank in the CP group.
        cp_size: the CP group size.
        spec: the layer's :class:`LayerSpec`.
        plan: this rank's :class:`~hp_cp_core.plan.RankPlan` (cached index arrays).
        config: the :class:`DeepSeekV4CPConfig` of the ``enable_cp`` call.
        cu_seqlens: global packed document boundaries (numpy), ``None`` when padded.
        cmp_kv_global: main compressed KV ``[n, (batch,) D]`` in global slot order, slots
            ``0 .. plan.n_needed_slots - 1``; ``None`` before the gather or when r = 0.
        cmp_idx_global: indexer keys, same rows as ``cmp_kv_global``; ``None`` when absent.
        ops: the module's :class:`~hp_cp_core.backend.Backend` (tensor ops for core helpers).
        extra: backend-private values the install wrapper passes to its own hooks.
        group: the CP :class:`~hp_cp_core.backend.Group` (for
            :func:`hp_cp_core.indexer_loss.global_indexer_loss`).
        loss_rows: rows (batch x tokens) of *all* ranks that count in the indexer loss's
            mean; see Note [Indexer loss under CP] in :mod:`hp_cp_core.indexer_loss`.
        roles: this layer's :class:`~hp_cp_core.sharing.LayerRoles` (what it makes, reuses
            and publishes); ``None`` for a layer planned alone.
        reused: the artifacts this layer received from the layers that made them (keys of
            :data:`ARTIFACTS` in ``spec.reuses``): ``"selection"`` is the owner's per-query
            top-k (whatever the owner's backend published: global slot ids, ``-1`` = none);
            the gathered slots are already in ``cmp_kv_global`` / ``cmp_idx_global``.
        outputs: where ``hp_cp_run_attention`` puts what this layer publishes for later
            layers: ``outputs["selection"]`` when ``roles.publishes("selection")`` (the
            core checks it is there and hands it on, with no collective).
    """

    cp_rank: int
    cp_size: int
    spec: LayerSpec
    plan: RankPlan
    config: DeepSeekV4CPConfig
    cu_seqlens: np.ndarray | None = None
    cmp_kv_global: Any = None
    cmp_idx_global: Any = None
    ops: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    group: Any = None
    loss_rows: int = 0
    roles: Any = None
    reused: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)

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

    def replace(self, **changes: Any) -> DeepSeekV4CPContext:
        """A copy with some fields changed (the context is frozen)."""
        return dataclasses.replace(self, **changes)
