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

__all__ = ["GRIDS", "LayerSpec"]

GRIDS = ("per_document", "global")


@dataclass(frozen=True)
class LayerSpec:
    """What the core needs to know about one attention layer (from ``hp_cp_layer_spec``).

    Attributes:
        compress_ratio: 0 (sliding window only), 1 (every row is its own slot: a projection,
            no pooling), or a pooling ratio >= 2 such as 4 (CSA) or 128 (HCA).
        window_size: W, keys ``t-W+1 .. t`` (the query itself included).
        has_indexer: the layer compresses indexer keys of its own (a second compressor whose
            slots travel with the main ones).
        force_unfused: the module asked for the small-op (unfused) attention path.
        packed_grid: ``"per_document"`` (DeepSeek / Megatron: grid, RoPE and window restart
            at each document) or ``"global"`` (MindFormers: blocks on the global grid, valid
            only inside one document).
        overlapping: a slot also reads the previous block; ``None`` is DeepSeek V4's rule
            (r = 4 overlaps, other ratios do not). DeepSeek V4.1 pools without overlap at
            every ratio (``False``).
        shares_slots: the layer reads the compressed slots (and indexer keys) another layer
            of the same ratio made earlier in the forward (DeepSeek V4.1's Reindex and Reuse
            layers): the plan has the slots' visibility, but the layer exchanges only its
            window halo, compresses nothing and receives no slot (Note [Shared slots] in
            :mod:`hp_cp_core.sharing`).
    """

    compress_ratio: int
    window_size: int = 128
    has_indexer: bool = False
    force_unfused: bool = True
    packed_grid: str = "per_document"
    overlapping: bool | None = None
    shares_slots: bool = False

    def __post_init__(self) -> None:
        r = int(self.compress_ratio)
        if r < 0:
            raise HpCpError(
                f"LayerSpec.compress_ratio={self.compress_ratio!r}: expected 0 (sliding window), "
                "1 (a slot per row) or a ratio >= 2 such as 4 (CSA) or 128 (HCA)."
            )
        if int(self.window_size) < 1:
            raise HpCpError(f"LayerSpec.window_size must be >= 1, got {self.window_size}.")
        if self.packed_grid not in GRIDS:
            raise HpCpError(f"LayerSpec.packed_grid={self.packed_grid!r}: expected one of {GRIDS}.")
        if self.has_indexer and r == 0:
            raise HpCpError("LayerSpec.has_indexer=True needs compress_ratio > 0.")
        if self.overlapping and r < 2:
            raise HpCpError(
                f"LayerSpec.overlapping=True needs a pooling ratio >= 2, got {r}: a slot of "
                "ratio 1 is one row, with no block before it to overlap."
            )
        if self.shares_slots and (r == 0 or self.has_indexer):
            raise HpCpError(
                "LayerSpec.shares_slots=True needs compress_ratio > 0 and has_indexer=False: "
                "a layer reading another layer's slots compresses nothing itself (got "
                f"compress_ratio={r}, has_indexer={self.has_indexer})."
            )

    @property
    def overlap(self) -> bool:
        """Whether a slot also reads the previous block (V4's r = 4 compressor by default)."""
        if self.overlapping is None:
            return int(self.compress_ratio) == 4
        return bool(self.overlapping)
