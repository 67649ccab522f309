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

from dataclasses import dataclass
from typing import Any

import numpy as np

from hp_cp_core.layout import Documents
from hp_cp_core.padding import CPPadding, pad_for_cp

__all__ = ["BatchPlan", "CPBatch", "plan_batch"]

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
    """

    input_ids: Any
    position_ids: Any
    labels: Any
    n_tokens: Any
    cu_seqlens: Any
    plan: BatchPlan | None = None

    def model_inputs(self, cu_seqlens_key: str = CU_SEQLENS_KWARG) -> dict[str, Any]:
        """The model's keyword arguments: ids, positions and, packed, the boundaries under
        ``cu_seqlens_key`` (the shipped integrations read ``hp_cp_cu_seqlens``)."""
        out: dict[str, Any] = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.cu_seqlens is not None:
            out[cu_seqlens_key] = self.cu_seqlens
        return out
