"""The inverse of data-dependent column lists, built on the device: for each pool row, the
``(query row, column)`` pairs that read it (CSR), for a backward whose programs own pool
rows and write each row's gradient once (:mod:`hp_cp_torch.kernels.triton_attention`).

Note [Inverting the picks]
--------------------------
A counting sort keyed by the pool row: a histogram of the keys (``scatter_add_``), its
prefix sum for the offsets, and a stable sort of the keys for the positions (on CUDA a radix
sort, i.e. counting-sort passes), so the entries of one row keep the flat order of
``idx``: by query row, then column. ``-1`` columns get the key ``n_pool_rows`` and land
after the last row::

    idx  (S = 3, K = 2)       keys (flat)      sorted keys     offsets (P = 4)
    q0: [ 2, -1 ]             2 4              0 2 2 2 4 4     [0, 1, 1, 4, 4]
    q1: [ 2,  2 ]             2 2              entries:        row 0: (q2, c0)
    q2: [ 0, -1 ]             0 4              (q2,0) (q0,0)   row 2: (q0, c0) (q1, c0)
                                               (q1,0) (q1,1)          (q1, c1)

Every op is deterministic (``torch.use_deterministic_algorithms(True)`` accepts them: a
one-dimensional ``scatter_add_``, ``cumsum`` and a stable sort) and none synchronises with the
host unless the entries are trimmed to ``nnz``. The window and HCA columns never come here:
their readers are ranges derived from the plan (:class:`hp_cp_core.columns.ColumnBands`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["InvertedIndex", "build_inverted_index"]


@dataclass(frozen=True)
class InvertedIndex:
    """Readers of each pool row, CSR.

    Attributes:
        offsets: ``[P + 1]`` int64; row ``r``'s entries are ``offsets[r] .. offsets[r + 1]``.
        query_rows: ``[nnz]`` (or ``[S * K]`` untrimmed) int64 query row of each entry.
        columns: ``[nnz]`` (or ``[S * K]``) int64 column position of each entry.
    """

    offsets: torch.Tensor
    query_rows: torch.Tensor
    columns: torch.Tensor

    @property
    def nnz(self) -> int:
        """Entries that read a row (synchronises with the device)."""
        return int(self.offsets[-1])


def build_inverted_index(
    idx: torch.Tensor, n_pool_rows: int, *, trim: bool = True
) -> InvertedIndex:
    """Invert column lists ``idx`` ``[S, K]`` (``-1`` = no pick, duplicates allowed) over
    ``n_pool_rows`` pool rows; entries of a row sorted by query row, then column (Note
    [Inverting the picks]).

    Args:
        idx: integer ``[S, K]`` pool rows, each ``-1`` or in ``[0, n_pool_rows)``.
        n_pool_rows: pool rows ``P``.
        trim: cut the entry arrays to ``nnz`` (one host synchronisation); untrimmed, they keep
            ``S * K`` entries and those past ``offsets[-1]`` are the ``-1`` columns.

    Returns:
        The :class:`InvertedIndex`, on ``idx``'s device.
    """
    if idx.dim() != 2:
        raise ValueError(f"idx must be [S, K], got shape {tuple(idx.shape)}")
    n_cols = idx.shape[1]
    n = int(n_pool_rows)
    flat = idx.reshape(-1).to(torch.int64)
    keys = torch.where(flat >= 0, flat, n)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=idx.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=idx.device)
    offsets[1:] = counts[:n].cumsum(0)
    order = torch.sort(keys, stable=True).indices
    order = order[: int(offsets[-1])] if trim else order
    return InvertedIndex(
        offsets=offsets,
        query_rows=torch.div(order, max(n_cols, 1), rounding_mode="floor"),
        columns=order % max(n_cols, 1),
    )
