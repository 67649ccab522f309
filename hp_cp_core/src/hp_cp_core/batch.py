"""One causal-LM batch under CP, planned once in numpy: positions, padding, shifted labels,
the token count and the packed boundaries (``handle.batch`` lays the tensors out).

Note [One batch path]
~~~~~~~~~~~~~~~~~~~~~
Every stack trains a causal LM on the same batch: the FULL token ids ``[B, S]`` (and
labels, default the ids), padded or packed (``cu_seqlens``, batch 1). What each rank needs
is decided by the sequence length, the CP group and the documents alone, so it is planned
here, once, for every framework (:func:`plan_batch`, per global row ``t`` of the padded
stream of ``P = pad_for_cp(S).padded_rows`` rows)::

    position[t]      t - first row of t's document  (t when not packed)
    label_source[t]  t + 1 when t + 1 < S and t + 1 is in t's document, else -1
    shifted[b, t]    labels[b, label_source[t]], or ignore_index where the source is -1
    n_tokens         count of shifted != ignore_index (the loss's divisor, whole batch)
    cu_seqlens       the documents, the padding its own trailing one (packed only)

The padding rows (``t >= S``) are token 0 with no target (Note [Padding to the layout] in
:mod:`hp_cp_core.padding`). Shifting on the FULL sequence is what makes the shards right: a
shard's last row still predicts the next rank's first token, and a load-balanced shard never
pairs rows of different chunks. A document's last token predicts nothing (the next one
starts another document).

``CPHandle.batch`` reads the labels to the host once (the count needs their values), makes
the positions, shifted labels and count as tensors with the backend's ``as_tensor`` op and
cuts this rank's rows with ``shard``. A stack's helper only translates its own input format
into ``cu_seqlens`` (NeMo's ``seq_lens`` / ``packed_seq_ids``, VeOmni's per-document
``position_ids``) and its own model keyword names.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hp_cp_core.errors import HpCpError
from hp_cp_core.layout import Documents
from hp_cp_core.padding import CPPadding, pad_for_cp

__all__ = [
    "BatchPlan",
    "CPBatch",
    "cu_seqlens_from_ids",
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_positions",
    "plan_batch",
]

CU_SEQLENS_KWARG = "hp_cp_cu_seqlens"
"""The model keyword the shipped integrations read packed boundaries from."""


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """What every rank needs of one batch, as global per-row arrays (Note [One batch path]).

    Attributes:
        padding: the sequence's padding (``rows`` real, ``padded_rows`` after it).
        cu_seqlens: ``[n_docs + 1]`` packed boundaries of the padded stream (the padding its
            own trailing document), or ``None`` for a padded batch.
        positions: ``[padded_rows]`` int64, each row's position within its document.
        documents: ``[padded_rows]`` int64, each row's document (0 when not packed).
        label_source: ``[padded_rows]`` int64, the column of the labels each row is trained
            to predict, ``-1`` for none.
    """

    padding: CPPadding
    cu_seqlens: np.ndarray | None
    positions: np.ndarray
    documents: np.ndarray
    label_source: np.ndarray

    @property
    def rows(self) -> int:
        """Real rows (tokens) of the sequence."""
        return self.padding.rows

    @property
    def padded_rows(self) -> int:
        return self.padding.padded_rows

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def shifted_labels(self, labels: np.ndarray, ignore_index: int = -100) -> np.ndarray:
        """``[B, padded_rows]``: each row's target, ``ignore_index`` where it has none."""
        labels = np.asarray(labels)
        ext = np.concatenate(
            [labels, np.full((*labels.shape[:-1], 1), ignore_index, dtype=labels.dtype)], -1
        )
        source = np.where(self.label_source >= 0, self.label_source, labels.shape[-1])
        return ext[..., source]


def plan_batch(
    rows: int, cp_size: int, layout: str = "contiguous", cu_seqlens: object = None
) -> BatchPlan:
    """Plan a batch of ``rows`` tokens per sequence for ``cp_size`` ranks in ``layout``.

    Args:
        rows: the global sequence length ``S``.
        cp_size: ranks of the CP group.
        layout: ``"contiguous"`` or ``"load_balanced"``.
        cu_seqlens: packed boundaries ``[0, ..., S]`` of the real tokens, or ``None``.

    Raises:
        PlanError: boundaries that do not rise from 0 to ``rows``, or a bad length / layout.
    """
    padding = pad_for_cp(rows, cp_size, layout)
    padded = padding.padded_rows
    all_rows = np.arange(padded, dtype=np.int64)
    if cu_seqlens is None:
        cu = None
        documents = np.zeros(padded, dtype=np.int64)
        positions = all_rows.copy()
        ends = np.array([padding.rows], dtype=np.int64)
    else:
        real = Documents.packed(cu_seqlens, padding.rows).cu_seqlens  # the core's check
        cu = padding.cu_seqlens(real)
        docs = Documents.packed(cu, padded)
        documents = docs.doc_of(all_rows)
        positions = all_rows - docs.start_of(all_rows)
        ends = real[1:]
    source = all_rows + 1
    last = np.zeros(padded, dtype=bool)
    last[ends[ends > 0] - 1] = True  # a document's last token predicts nothing
    source[last | (all_rows >= padding.rows)] = -1  # nor does the padding
    return BatchPlan(padding, cu, positions, documents, source)


# ------------------------------------------------------------ a stack's packed format


def cu_seqlens_from_lengths(
    lengths: Any, total: int, *, unused: int | None = None, name: str = "seq_lens"
) -> np.ndarray:
    """Packed boundaries ``[0, ..., total]`` from document lengths (``[n]`` or ``[1, n]``;
    entries equal to ``unused`` are skipped, NeMo's ``-1000``). Every token, padding
    included, must belong to a document.

    Raises:
        HpCpError: several rows, a negative length, or lengths not summing to ``total``.
    """
    lens = np.asarray(lengths).astype(np.int64)
    if lens.ndim == 2:
        if lens.shape[0] != 1:
            raise HpCpError(
                f"{name} has {lens.shape[0]} rows; hp_cp packs one stream per step under CP: "
                f"pass input_ids [1, S] with {name} [1, n_docs] (pack the rows into one)."
            )
        lens = lens[0]
    if unused is not None:
        lens = lens[lens != unused]
    if lens.ndim != 1 or (lens < 0).any() or int(lens.sum()) != total:
        skip = "" if unused is None else f" (unused entries {unused})"
        raise HpCpError(
            f"{name} {lens[:8].tolist()} must be non-negative document lengths{skip} summing "
            f"to the sequence length {total}; got sum {int(lens.sum())}. Give every token, "
            "padding included, to a document."
        )
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def cu_seqlens_from_ids(ids: Any, total: int, *, name: str = "packed_seq_ids") -> np.ndarray:
    """Packed boundaries from one document id per token (each document one contiguous run).

    Raises:
        HpCpError: not ``total`` ids, or a document that comes back after another started.
    """
    ids = np.asarray(ids).astype(np.int64).reshape(-1)
    if ids.size != total:
        raise HpCpError(
            f"{name} has {ids.size} entries for a sequence of {total} tokens; pass one id per "
            "token of the full (unsharded) sequence, shape [1, S]."
        )
    starts = np.flatnonzero(np.diff(ids)) + 1
    runs = ids[np.concatenate([[0], starts])] if ids.size else ids
    if np.unique(runs).size != runs.size:
        raise HpCpError(
            f"{name} revisits a document after another one started; each document must be "
            "one contiguous run of equal ids."
        )
    return np.concatenate([[0], starts, [total]]).astype(np.int64)


def cu_seqlens_from_positions(
    positions: Any, total: int, *, name: str = "position_ids"
) -> np.ndarray | None:
    """Packed boundaries from per-document positions (``0, 1, ..`` restarting at 0 in every
    document) of one row; ``None`` when the row is one document.

    Raises:
        HpCpError: several rows, or positions that do not count up from 0 per document.
    """
    pos = np.asarray(positions).astype(np.int64).reshape(-1, total)
    if pos.shape[0] != 1:
        raise HpCpError(
            f"{name} of {pos.shape[0]} rows: packed input is one row; for a padded batch of "
            f"several rows omit {name}."
        )
    starts = np.flatnonzero(pos[0] == 0)
    if starts.size == 0 or starts[0] != 0:
        raise HpCpError(f"packed {name} must start at 0 (they restart at 0 in every document).")
    cu = np.append(starts, total)
    doc_start = np.repeat(starts, np.diff(cu))
    if not np.array_equal(pos[0], np.arange(total) - doc_start):
        raise HpCpError(
            f"{name} must count 0, 1, 2, ... within each document (the packed format); got "
            "positions that skip or repeat."
        )
    return None if cu.size == 2 else cu


def batch_digest(input_ids: np.ndarray, labels: np.ndarray, cu_seqlens: Any) -> int:
    """A nonzero digest of a full batch (its ids, labels and packed boundaries, with their
    shapes): what the ranks of a CP group compare to find one given another batch."""
    crc = 0
    for part in (input_ids, labels, cu_seqlens):
        if part is not None:
            values = np.ascontiguousarray(part)
            crc = zlib.crc32(f"{values.shape}{values.dtype.str}".encode(), crc)
            crc = zlib.crc32(values.tobytes(), crc)
    return crc + 1


@dataclass
class CPBatch:
    """This rank's part of a causal-LM batch (what ``CPHandle.batch`` returns).

    Attributes:
        input_ids: this rank's rows of the ids, padding token 0.
        position_ids: ``[1, local rows]``, each row's position within its document.
        labels: this rank's rows of the shifted labels (``ignore_index`` without a target).
        n_tokens: the targets of the whole batch (a 0-d integer tensor): the divisor of the
            loss's sum; sum it over data-parallel ranks for a mean over the global batch.
        cu_seqlens: the packed boundaries of the padded stream (global, a CPU tensor) or
            ``None``.
        plan: the numpy plan the tensors were made from.
        sequence: the handle's padding record (:class:`~hp_cp_core.padding.ShardedSequence`)
            that :meth:`model_inputs` points at this batch again.
        digest: a digest of the full batch (ids, labels, boundaries) that the forward's
            agreement compares across the CP ranks: every rank of a group must be given
            the same batch.
    """

    input_ids: Any
    position_ids: Any
    labels: Any
    n_tokens: Any
    cu_seqlens: Any
    plan: BatchPlan | None = None
    sequence: Any = field(default=None, repr=False, compare=False)
    digest: int = field(default=0, repr=False, compare=False)

    def model_inputs(self, cu_seqlens_key: str = CU_SEQLENS_KWARG) -> dict[str, Any]:
        """The model's keyword arguments: ids, positions and, packed, the boundaries under
        ``cu_seqlens_key`` (the shipped integrations read ``hp_cp_cu_seqlens``).

        It also records this batch's padding on the handle again (Note [Padding to the
        layout]), so that the forward it feeds leaves this batch's padding rows out of the
        indexer loss even when later batches were built before it (prefetched micro-batches).
        """
        if self.sequence is not None and self.plan is not None:
            self.sequence.record_batch(self.plan.rows, self.plan.padded_rows, self.digest)
        out: dict[str, Any] = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.cu_seqlens is not None:
            out[cu_seqlens_key] = self.cu_seqlens
        return out
