"""Any sequence length under CP: how many rows to pad, and the packed boundaries after it.

Note [Padding to the layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A layout cuts the sequence into equal chunks (``cp`` contiguous, ``2 * cp`` load-balanced),
so the row count must be a multiple of the chunk count. Any other length is padded at the
END with rows the loss ignores::

    S = 7, cp = 2, load-balanced (4 chunks of 2)     rows:  t0 t1 t2 t3 t4 t5 t6 p
                                                    rank 0: t0 t1 | t6 p    rank 1: t2 t3 | t4 t5

Trailing rows change nothing before them: attention is causal, a window or compressed slot
that contains a padding row ends after it, so only padding queries see it. Packed input
(``cu_seqlens``) gets the padding as its own trailing document, so not even a padding query
attends into a real document. The loss must skip the padding rows: labels set to the ignore
index (``handle.shard(labels, 1, pad_value=-100)``), or a mask (``pad_value=0`` on a tensor
of ones) for the indexer loss's ``loss_mask``.

The indexer's KL loss skips them by itself: ``handle.shard`` records the padding of the
sequence it sharded last (:class:`ShardedSequence`), and a layer whose global row count is
that padded length leaves the rows at or past the real length out of the loss's sum and its
divisor (a cell without a loss mask, such as MindFormers', has no other way to tell)::

    handle.shard(ids, 1, pad_value=0)      records  7 real rows of 8
    handle.shard(arange(8), 0)             same length: the record stays
    layer forward over 8 global rows    -> rows 0..6 count, row 7 does not (N = 7 * batch)
    layer forward over 6 global rows    -> another sequence: every row counts
    handle.shard(t6, 1)                    another length, no pad_value: the record goes

Pass ``pad_value`` on every step's inputs: a sequence of exactly 8 real rows sharded
without it right after the one above would count as the padded one. The record is the LAST
sharded sequence's, so a batch built ahead of another (prefetched micro-batches) must be
recorded again before its forward: ``CPBatch.model_inputs()`` does it, so
``model(**batch.model_inputs())`` is right in any order; with ``shard`` alone, shard a
batch's ids with ``pad_value`` again right before its forward.

The math is here (numpy); the backends pad the tensors with their ``pad_dim`` op.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hp_cp_core.errors import PlanError
from hp_cp_core.layout import SequenceLayout

__all__ = ["CPPadding", "ShardedSequence", "pad_for_cp"]


@dataclass(frozen=True)
class CPPadding:
    """What padding a sequence of ``rows`` rows for a layout adds.

    Attributes:
        rows: the real rows (tokens) of the sequence.
        padded_rows: rows after padding: the smallest multiple of the layout's chunk count
            that is at least ``rows``.
    """

    rows: int
    padded_rows: int

    @property
    def pad_rows(self) -> int:
        """Rows appended at the end (0 when ``rows`` already fits the layout)."""
        return self.padded_rows - self.rows

    def cu_seqlens(self, cu_seqlens: object = None) -> np.ndarray:
        """Packed boundaries of the padded stream: the padding is its own trailing document.

        ``cu_seqlens=None`` (one padded sequence) gives ``[0, padded_rows]``: the padding
        then trails the sequence in the same document, which is equally exact for causal
        attention.
        """
        if cu_seqlens is None:
            return np.array([0, self.padded_rows], dtype=np.int64)
        cu = np.asarray(cu_seqlens).astype(np.int64).reshape(-1)
        if cu.size < 1 or int(cu[-1]) != self.rows:
            raise PlanError(
                f"cu_seqlens must end at the sequence's {self.rows} real rows before padding; "
                f"got {cu[:8].tolist()}{'...' if cu.size > 8 else ''}. Pass the unpadded "
                "boundaries of the full (global) sequence."
            )
        if self.pad_rows == 0:
            return cu
        return np.concatenate([cu, np.array([self.padded_rows], dtype=np.int64)])

    def real_rows(self) -> np.ndarray:
        """``[padded_rows]`` bool: True for real rows, False for padding."""
        return np.arange(self.padded_rows) < self.rows


def pad_for_cp(rows: int, cp_size: int, layout: str = "contiguous") -> CPPadding:
    """The padding a sequence of ``rows`` rows needs to be sharded over ``cp_size`` ranks.

    Args:
        rows: global sequence length (tokens), >= 0.
        cp_size: ranks of the CP group.
        layout: ``"contiguous"`` or ``"load_balanced"``.

    Raises:
        PlanError: a negative length, a cp size below 1 or an unknown layout.
    """
    rows = int(rows)
    if rows < 0:
        raise PlanError(f"a sequence cannot have {rows} rows; pass its length (>= 0).")
    if layout not in ("contiguous", "load_balanced"):
        raise PlanError(f"layout must be 'contiguous' or 'load_balanced', got {layout!r}.")
    parts = SequenceLayout(layout, int(cp_size), 0).n_chunks
    return CPPadding(rows, -(-rows // parts) * parts)


class ShardedSequence:
    """The padding of the sequence a handle sharded last (Note [Padding to the layout]).

    ``CPHandle.shard(..., pad_value=...)`` records each call, padded or not, so a later
    sequence that needs no padding replaces an earlier padded one; a call without
    ``pad_value`` on another length forgets it. Layers read it through :meth:`real_rows`.
    """

    def __init__(self) -> None:
        self.padding: CPPadding | None = None
        self.cu_seqlens: np.ndarray | None = None
        self.batch_digest = 0
        """A digest of the batch ``handle.batch`` built last (0: the record is not a
        batch's): the forward's agreement compares it across the ranks."""
        self.cut_rows: int | None = None
        """The global length of the last tensor ``handle.shard`` cut (padding included)."""

    def copy(self) -> ShardedSequence:
        """A copy of this record (a forward's own: Note [Records per forward])."""
        out = ShardedSequence()
        out.padding, out.cu_seqlens, out.batch_digest = (
            self.padding,
            self.cu_seqlens,
            self.batch_digest,
        )
        out.cut_rows = self.cut_rows
        return out

    def record(self, rows: int, padded_rows: int) -> None:
        """Note that the last sharded sequence has ``rows`` real rows of ``padded_rows``
        (another length also forgets the packed boundaries of :meth:`record_documents`)."""
        padding = CPPadding(int(rows), int(padded_rows))
        if padding != self.padding:
            self.cu_seqlens = None
        self.padding = padding
        self.batch_digest = 0

    def record_batch(self, rows: int, padded_rows: int, batch_digest: int) -> None:
        """:meth:`record`, for a batch ``handle.batch`` built (``batch_digest`` of it)."""
        self.record(rows, padded_rows)
        self.batch_digest = int(batch_digest)

    def batch_for(self, total_rows: int) -> int:
        """The recorded batch digest when a forward over ``total_rows`` global rows is the
        recorded sequence, else 0."""
        pad = self.padding
        return self.batch_digest if pad is not None and pad.padded_rows == total_rows else 0

    def record_documents(self, cu_seqlens: object) -> None:
        """The packed boundaries of the last sharded sequence (global, padding included:
        ``CPPadding.cu_seqlens``), for layers whose model hands them per-row document ids
        only (NeMo DeepSeek V4.1's ``packed_seq_ids``). Ending at another length than the
        recorded padded one is a :class:`PlanError`."""
        cu = np.asarray(cu_seqlens).astype(np.int64).reshape(-1)
        pad = self.padding
        if pad is None or cu.size < 2 or int(cu[-1]) != pad.padded_rows:
            raise PlanError(
                f"packed boundaries ending at {int(cu[-1]) if cu.size else 'nothing'} do not "
                f"belong to the sequence sharded last ({'none' if pad is None else pad}); "
                "shard the inputs with handle.shard(..., pad_value=...) first, then record "
                "handle.padding(rows).cu_seqlens(cu)."
            )
        self.cu_seqlens = cu

    def documents(self, total_rows: int) -> np.ndarray | None:
        """The recorded packed boundaries when a forward over ``total_rows`` global rows is
        the recorded sequence, else ``None``."""
        pad = self.padding
        if self.cu_seqlens is None or pad is None or pad.padded_rows != int(total_rows):
            return None
        return self.cu_seqlens

    def forget_unless(self, padded_rows: int) -> None:
        """Forget the record unless ``padded_rows`` is its padded length (a tensor of the
        same sequence, sharded without ``pad_value``)."""
        if self.padding is not None and self.padding.padded_rows != int(padded_rows):
            self.padding = None
            self.cu_seqlens = None
            self.batch_digest = 0

    def real_rows(self, kind: str, cp_size: int, rank: int, total_rows: int) -> np.ndarray | None:
        """``[rows of rank]`` bool, True for this rank's real rows, when a forward over
        ``total_rows`` global rows (``kind`` layout over ``cp_size`` ranks) is the recorded
        padded sequence and it has padding; else ``None`` (every row is real). Never raises:
        a length the layout cannot take is the forward's own check to report."""
        pad = self.padding
        if pad is None or pad.pad_rows == 0 or pad.padded_rows != int(total_rows):
            return None
        layout = SequenceLayout(kind, int(cp_size), int(total_rows))  # fits: pad_for_cp made it
        return layout.shard_index(rank) < pad.rows
