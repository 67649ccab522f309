"""How global rows map to ranks (contiguous / load-balanced) and to documents (padded / packed).

Note [Row layouts]
~~~~~~~~~~~~~~~~~~
Rows are the tokens of one sequence (padded: every batch row shares the layout) or of the
packed stream (``cu_seqlens``). With ``cp`` ranks and ``S`` rows, ``L = S / cp``::

    contiguous, cp = 4          rank:  0     1     2     3
                                rows: [0,L) [L,2L) ...

    load_balanced, cp = 4       chunks of C = S / 8:  c0 c1 c2 c3 c4 c5 c6 c7
                                rank 0 holds c0 + c7, rank 1 c1 + c6, rank 2 c2 + c5, rank 3 c3 + c4

Causal work grows with position, so pairing an early chunk with a late one evens it out.
A rank's local rows are its chunks in ascending order; each chunk is one contiguous *run*.
Everything else (halos, slot ownership) follows from :meth:`SequenceLayout.rank_of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hp_cp_core.errors import PlanError


@dataclass(frozen=True)
class SequenceLayout:
    """Which rank holds which global row.

    Attributes:
        kind: ``"contiguous"`` or ``"load_balanced"``.
        cp_size: number of ranks.
        total_rows: rows of the whole sequence (tokens).
    """

    kind: str
    cp_size: int
    total_rows: int

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise PlanError(f"cp size must be >= 1, got {self.cp_size}.")
        parts = self.n_chunks
        if self.total_rows % parts:
            raise PlanError(
                f"a {self.kind} layout over cp={self.cp_size} ranks needs the sequence length to "
                f"be a multiple of {parts}; got {self.total_rows} rows. Pad it at the end: "
                "handle.shard(t, dim, pad_value=...) pads tensors and "
                "handle.padding(rows).cu_seqlens(cu) the packed boundaries."
            )

    @property
    def n_chunks(self) -> int:
        """Equal chunks the sequence is cut into (cp, or 2*cp when load-balanced)."""
        return self.cp_size * (2 if self.kind == "load_balanced" else 1)

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk (tokens)."""
        return self.total_rows // self.n_chunks

    @property
    def local_rows_per_rank(self) -> int:
        """L: rows each rank holds (tokens)."""
        return self.total_rows // self.cp_size

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Chunk ids held by ``rank``, in local order."""
        if self.kind == "load_balanced":
            return (rank, 2 * self.cp_size - 1 - rank)
        return (rank,)

    def runs(self, rank: int) -> list[tuple[int, int]]:
        """Contiguous global row ranges ``[start, stop)`` of ``rank``, in local order."""
        c = self.chunk_rows
        return [(k * c, (k + 1) * c) for k in self.chunks_of(rank)]

    def rank_rows(self, rank: int) -> np.ndarray:
        """Global rows of ``rank`` in local order (int64)."""
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.runs(rank)])

    def rank_of(self, rows: np.ndarray) -> np.ndarray:
        """Owning rank of each global row (vectorised)."""
        chunk = np.asarray(rows, dtype=np.int64) // max(self.chunk_rows, 1)
        if self.kind == "load_balanced":
            return np.where(chunk < self.cp_size, chunk, 2 * self.cp_size - 1 - chunk)
        return chunk

    def local_index(self, rows: np.ndarray) -> np.ndarray:
        """Position of each global row inside its owner's local rows (vectorised)."""
        rows = np.asarray(rows, dtype=np.int64)
        c = max(self.chunk_rows, 1)
        if self.kind == "load_balanced":
            second = (rows // c) >= self.cp_size
            return rows % c + np.where(second, c, 0)
        return rows % c

    def shard_index(self, rank: int) -> np.ndarray:
        """The rows to take from a full sequence to build ``rank``'s local tensor."""
        return self.rank_rows(rank)


@dataclass(frozen=True, eq=False)
class Documents:
    """Document boundaries of the global rows (one document when padded).

    Attributes:
        cu_seqlens: ``[n_docs + 1]`` int64 boundaries, ``0 .. total_rows``.
    """

    cu_seqlens: np.ndarray

    @staticmethod
    def padded(total_rows: int) -> Documents:
        """A single document covering every row."""
        return Documents(np.array([0, total_rows], dtype=np.int64))

    @staticmethod
    def packed(cu_seqlens: object, total_rows: int) -> Documents:
        """Validate user ``cu_seqlens`` against the global row count."""
        cu = np.asarray(cu_seqlens).astype(np.int64).reshape(-1)
        if cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != total_rows:
            head = cu[:8].tolist()
            raise PlanError(
                f"cu_seqlens must start at 0, be non-decreasing and end at the global row count "
                f"{total_rows} (local rows x cp); got {head}{'...' if cu.size > 8 else ''} ending "
                f"at {int(cu[-1]) if cu.size else 'nothing'}. Pass the same global cu_seqlens on "
                "every rank."
            )
        return Documents(cu)

    @property
    def total_rows(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def n_docs(self) -> int:
        return int(self.cu_seqlens.size - 1)

    @cached_property
    def lengths(self) -> np.ndarray:
        """Rows per document."""
        return np.diff(self.cu_seqlens)

    def doc_of(self, rows: np.ndarray) -> np.ndarray:
        """Document id of each global row (empty documents never own a row)."""
        return np.searchsorted(self.cu_seqlens, np.asarray(rows, dtype=np.int64), side="right") - 1

    def start_of(self, rows: np.ndarray) -> np.ndarray:
        """First row of each row's document."""
        return self.cu_seqlens[self.doc_of(rows)]
