"""The layer description every plan is built for (:class:`LayerSpec`, the answer of the
``hp_cp_layer_spec`` hook).

It imports nothing of hp_cp_core but the errors, so :mod:`hp_cp_core.plan` (which plans for a
spec) and :mod:`hp_cp_core.config` (whose per-call context holds a spec and a plan) both build
on it without importing each other. ``from hp_cp_core import LayerSpec`` and
``from hp_cp_core.config import LayerSpec`` give the same class.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_cp_core.errors import HpCpError

__all__ = ["ARTIFACTS", "GRIDS", "PER_QUERY", "LayerSpec"]

GRIDS = ("per_document", "global")

ARTIFACTS = ("compressed_kv", "index_keys", "selection", "candidates")
"""What a layer can reuse from an earlier one (``LayerSpec.reuses``); see Note [Layers that
share their indexer] in :mod:`hp_cp_core.sharing`."""

PER_QUERY = ("selection", "candidates")
"""The artifacts that are per local query (the others are gathered slot buffers): they never
travel; the owner's ``hp_cp_run_attention`` puts them in ``call.outputs``."""


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
    V4.1 CSA2 Reindex       r      W       True         ("compressed_kv", "index_keys"),
                                                        after the candidate source also
                                                        "candidates"
    V4.1 CSA2 Reuse         r      W       True         ("compressed_kv", "index_keys",
                                                        "selection")
    ======================  =====  ======  ===========  ======================================

    (V4.1 layers pool without overlap, ``overlapping=False``; from the two-level indexer's
    candidate source on, its compressed layers have ``index_block`` = the candidate block
    size.)

    Attributes:
        compress_ratio: 0 (sliding window only), 1 (no pooling: every token is its own
            slot, a row-wise projection or the identity; DSA, V4.1's ratio-1 layers), or a
            pooling ratio >= 2 such as 4 (CSA) or 128 (HCA). Slot j of ratio r covers rows
            ``[j*r, (j+1)*r)`` of its document and is visible to query t iff
            ``(j+1)*r <= t+1``: for r = 1 a token sees itself.
        window_size: W, keys ``t-W+1 .. t`` (the query itself included); 0 means no sliding
            window (DSA: the layer reads only its selected slots).
        has_indexer: the layer's attention reads an indexer top-k of its visible slots (its
            own indexer, or a selection it reuses). CSA's indexer has its own compressor; a
            ratio-1 indexer scores tokens.
        force_unfused: the module asked for the small-op (unfused) attention path.
        packed_grid: ``"per_document"`` (DeepSeek / Megatron: grid, RoPE and window restart
            at each document) or ``"global"`` (MindFormers: blocks on the global grid, valid
            only inside one document).
        overlapping: a slot also reads the previous block; ``None`` is DeepSeek V4's rule
            (r = 4 overlaps, other ratios do not). DeepSeek V4.1 pools without overlap at
            every ratio (``False``).
        index_block: two-level indexer: 0 (one level: top-k of the visible slots) or b >= 1:
            the indexer first scores candidate blocks of b consecutive slots of a document
            (block c of a document holds its slots ``c*b .. c*b + b - 1``; a query sees a
            block when it sees the block's first slot), keeps the best ones, then takes the
            top-k over the slots of the kept blocks
            (:meth:`hp_cp_core.columns.PlanColumns.block_visibility`,
            :func:`hp_cp_core.columns.select_two_level_numpy`). It moves nothing more: the
            block keys are computed from the gathered index keys, token-locally. The kept
            blocks may come from an earlier layer (``reuses`` ``"candidates"``, Note
            [Two-level selection] in :mod:`hp_cp_core.columns`).
        reuses: what the layer receives from an earlier layer instead of computing it, a
            subset of :data:`ARTIFACTS`: ``"compressed_kv"`` (the gathered main compressed
            KV), ``"index_keys"`` (the gathered indexer keys), ``"selection"`` (the indexer
            top-k of each local query), ``"candidates"`` (the candidate blocks a two-level
            indexer kept for each local query; the layer takes its own top-k among them). A
            reused artifact costs no collective: the layer that made it gathered it once for
            the whole group of layers (:func:`hp_cp_core.sharing.plan_sharing` says which
            layer owns what). A layer
            that makes no slot of its own (it reuses ``"compressed_kv"`` and, with an
            indexer, the index keys or the selection) has no compressor: its plan has the
            slots' visibility but no x halo and no slot exchange.
        share_from: the index (among the layers ``enable_cp`` found, in order) of the layer
            whose artifacts this one reuses; ``None``: for each artifact, the nearest
            earlier layer that makes it.
    """

    compress_ratio: int
    window_size: int = 128
    has_indexer: bool = False
    force_unfused: bool = True
    packed_grid: str = "per_document"
    overlapping: bool | None = None
    index_block: int = 0
    reuses: tuple[str, ...] = ()
    share_from: int | None = None

    def __post_init__(self) -> None:
        r = int(self.compress_ratio)
        if r < 0:
            raise HpCpError(
                f"LayerSpec.compress_ratio={self.compress_ratio!r}: expected 0 (sliding window), "
                "1 (a slot per row: DSA) or a ratio >= 2 such as 4 (CSA) or 128 (HCA)."
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
        if self.overlapping and r < 2:
            raise HpCpError(
                f"LayerSpec.overlapping=True needs a pooling ratio >= 2, got {r}: a slot of "
                "ratio 1 is one row, with no block before it to overlap."
            )
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
        indexer_artifacts = ("index_keys", "selection", "candidates")
        if any(a in self.reuses for a in indexer_artifacts) and not self.has_indexer:
            raise HpCpError(
                f"LayerSpec.reuses={self.reuses!r} names the indexer's artifacts, so the layer "
                "reads an indexer selection: set has_indexer=True."
            )
        if "candidates" in self.reuses and (
            int(self.index_block) < 1 or "selection" in self.reuses
        ):
            raise HpCpError(
                f"LayerSpec.reuses={self.reuses!r} names 'candidates' (the candidate blocks of "
                "a two-level indexer), so the layer selects among them: set index_block >= 1 "
                "(the owner's block size) and do not reuse the selection as well."
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
            for n, default in (
                ("overlapping", None),
                ("index_block", 0),
                ("reuses", ()),
                ("share_from", None),
            )
            if getattr(self, n) != default
        ]
        return f"LayerSpec({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    @property
    def overlap(self) -> bool:
        """Whether a slot also reads the previous block (V4's r = 4 compressor by default)."""
        if self.overlapping is None:
            return int(self.compress_ratio) == 4
        return bool(self.overlapping)

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
    def makes_candidates(self) -> bool:
        """The layer chooses the candidate blocks of its two-level indexer itself (it has
        ``index_block`` >= 1, runs its own top-k and does not reuse the candidates)."""
        return (
            int(self.index_block) > 0 and self.makes_selection and "candidates" not in self.reuses
        )

    @property
    def makes_slots(self) -> bool:
        """The layer compresses slots of its own (main KV or index keys): its plan has the
        x halo of the blocks straddling a rank edge and a slot exchange. ``False`` for a
        layer that reuses every slot it reads (V4.1's Reindex and Reuse layers)."""
        return self.makes_compressed_kv or self.makes_index_keys

    @property
    def needs_halo(self) -> bool:
        """Whether the layer runs the halo exchange: it has a window (W >= 1; W = 1 reads no
        halo row but keeps the exchange, as a V4 layer always did), or a pooling compressor
        (r >= 2) of its own whose blocks may straddle ranks. ``False`` (DSA: r = 1, no
        window; a layer with no window reusing every slot) skips it on every rank."""
        return int(self.window_size) > 0 or (int(self.compress_ratio) >= 2 and self.makes_slots)
