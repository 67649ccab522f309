"""The parent attention's RoPE under CP: each rank's rows at their GLOBAL positions.

Note [The parent's RoPE under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In mindformers 2.1.0 the DeepSeek V4 hybrid attention (the parent of a
``CompressedSparseAttention`` cell) RoPEs the main query and key, and inverse-RoPEs the core
output, with ``freqs = self.rotary_pos_emb(sq)``: positions ``0 .. sq - 1`` of the rows it
holds. On one device those are the global positions; under CP a rank holds ``sq = L`` rows
of a longer sequence, so its rows must be RoPE'd where they sit in the whole sequence, or the
window keys of the halo (RoPE'd on the rank before) and the compressed slots (RoPE'd by the
compressor at their global position, ``rope_pos_offset``) meet the local queries at the
wrong relative distance::

    S = 16, cp = 2, load-balanced        rank 0 rows:  0  1  2  3 | 12 13 14 15
    4 chunks of 4                        rank 1 rows:  4  5  6  7 |  8  9 10 11
    the parent asks rotary_pos_emb(8):   positions 0..7 on both ranks   (wrong)
    GlobalPositionRotary gives rank 0:   table(16)[0 1 2 3 12 13 14 15] (right)

:class:`GlobalPositionRotary` stands in the parent's ``rotary_pos_emb`` while CP is on: it
computes the table of the whole sequence (``sq * cp`` rows) and takes this rank's rows, in
the layout's order (``SequenceLayout.shard_index``: the core's index math). Calls with an
explicit ``offset`` or ``position_ids`` (the compressor's and the indexer's, which already
pass global positions) go to the wrapped cell unchanged. MindFormers' own CSA CP does the same
with a contiguous offset (``CPRotaryEmbeddingProxy``: ``cp_rank * sq``), which covers the
contiguous layout only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mindspore import Tensor, nn, ops

from hp_cp_core.layout import SequenceLayout

__all__ = ["GlobalPositionRotary", "rotary_parents", "wrap_parent_rotary"]


class GlobalPositionRotary(nn.Cell):
    """A parent attention's ``rotary_pos_emb`` under CP: ``base(sq)`` becomes this rank's
    ``sq`` rows of ``base(sq * cp_size)`` (see Note [The parent's RoPE under CP]).

    Args:
        base: the wrapped RoPE cell (``construct(max_seq_len, offset=0, position_ids=None)``
            returning ``(freqs [seq, ...], mscale)``).
        layout: the CP layout name (``"contiguous"`` or ``"load_balanced"``).
        cp_rank: this rank in the CP group.
        cp_size: the CP group size.
    """

    def __init__(self, base: nn.Cell, layout: str, cp_rank: int, cp_size: int) -> None:
        super().__init__()
        self.base = base
        self.layout = layout
        self.cp_rank = int(cp_rank)
        self.cp_size = int(cp_size)

    def global_rows(self, local_rows: int) -> np.ndarray:
        """The global positions of this rank's ``local_rows`` rows, in local order."""
        total = int(local_rows) * self.cp_size
        return SequenceLayout(self.layout, self.cp_size, total).shard_index(self.cp_rank)

    def construct(self, max_seq_len: int, offset: int = 0, position_ids: Any = None) -> Any:
        if offset != 0 or position_ids is not None:
            return self.base(max_seq_len, offset=offset, position_ids=position_ids)
        freqs, mscale = self.base(int(max_seq_len) * self.cp_size)
        rows = Tensor(np.asarray(self.global_rows(max_seq_len), dtype=np.int64))
        return ops.gather(freqs, rows, 0), mscale


def wrap_parent_rotary(
    parent: nn.Cell, layout: str, cp_rank: int, cp_size: int
) -> Callable[[], None]:
    """Put a :class:`GlobalPositionRotary` in ``parent.rotary_pos_emb``; returns the undo.

    Only the parent's attribute changes: the CSA cell and its compressors keep their own
    reference to the base cell (they pass global offsets themselves).
    """
    base = parent.rotary_pos_emb
    parent.rotary_pos_emb = GlobalPositionRotary(base, layout, cp_rank, cp_size)

    def undo() -> None:
        parent.rotary_pos_emb = base

    return undo


def rotary_parents(root: Any, layers: list[Any]) -> dict[int, nn.Cell]:
    """``{id(layer): parent}`` for every CSA ``layer`` under ``root`` whose parent holds it as
    ``core_attention`` next to a ``rotary_pos_emb`` cell (the DeepSeek V4 hybrid attention)."""
    wanted = {id(layer) for layer in layers}
    out: dict[int, nn.Cell] = {}
    cells = getattr(root, "cells_and_names", None)
    if cells is None:
        return out
    for _, cell in cells():
        core = getattr(cell, "core_attention", None)
        if id(core) in wanted and isinstance(getattr(cell, "rotary_pos_emb", None), nn.Cell):
            out[id(core)] = cell
    return out
