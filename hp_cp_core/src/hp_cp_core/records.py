"""Records per forward: what a CP forward reads after it began, kept for that forward only.

Note [Records per forward]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A forward leaves records that its own later reads need: the padding of its batch (the
indexer loss leaves those rows out; the one-process top-k row has the real length), the
artifacts its owner layers publish for the layers that reuse them (a shared selection, keys,
candidate blocks). Later reads come in a later layer of the same forward, in its backward,
or in a *recomputed* layer (activation checkpointing), which re-runs inside the backward::

    fwd A ──────────────┐          fwd B ─────┐        bwd A (recompute) ─────┐
    record A: pad 3 rows │          record B    │        reads record A, not B   │
    sel A (layer 0)      │          sel B       │        sel A for layer 1       │

Between a forward and its backward other forwards may run (1F1B pipelines, an evaluation
forward, a prefetched micro-batch). So each forward gets its own :class:`ForwardRecord`,
and a layer call reads the record of the forward it belongs to, never "the latest":

* A backend that sees a whole forward (torch: the hooks of the module passed to
  ``enable_cp``) opens a scope with :meth:`ForwardRecords.start` / :meth:`~ForwardRecords.enter`
  and finds a recomputed forward's record again from what the recomputation is given (the
  torch backend: the storages of its saved inputs).
* Without a scope, :meth:`ForwardRecords.for_layer` starts a new record when a layer runs
  whose index is not above the last layer of the current record (the model's layers run in
  order), as before records existed.

Note [A recomputation replays the agreement]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A layer call agrees on its inputs across the ranks, or reuses an earlier layer's agreement
of the same forward (no collective, no value check). A recomputed call must take the same
path: selective activation checkpointing replays the forward's ops in order and refuses a
recomputation that runs others, and the handle's agreement memo, which follows program
order, would otherwise decide anew. So each call notes in its forward's record how it
agreed (:class:`Agreed`), and a recomputed call (a scope opened with ``recomputing``) reuses
if its forward did, or runs the same full agreement again, leaving the memo as it is. Every
rank holds the same record, so every rank decides alike.

A record holds no framework object of its own beyond what the layers publish in it, and it
is freed when nothing refers to it: the backend ties it to the forward's graph.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

from hp_cp_core.padding import ShardedSequence
from hp_cp_core.sharing import SharedState


@dataclass(frozen=True)
class Agreed:
    """How one layer call agreed on its inputs (Note [A recomputation replays the agreement]).

    Attributes:
        reused: it reused an earlier layer's agreement (no collective, no value check).
        total: the agreed count it got (the indexer loss's rows), or ``None``.
        checks_skipped: the backend skipped its value checks (the objects were checked).
    """

    reused: bool
    total: int | None
    checks_skipped: bool = False


class ForwardRecord:
    """What one forward of a handle's model reads after it began.

    Attributes:
        number: the forward's number within its handle (1, 2, ...), for messages.
        sequence: the padding (and packed boundaries, batch digest) of the forward's batch:
            a copy of what ``handle.shard`` / ``handle.batch`` recorded for it.
        shared: what the forward's owner layers published for the layers reusing it.
        last_layer: the highest layer index that has run in this forward (-1: none yet).
    """

    def __init__(self, number: int, sequence: ShardedSequence) -> None:
        self.number = number
        self.sequence = sequence
        self.shared = SharedState()
        self.last_layer = -1
        self.cut = False
        """Whether the forward was given tensors ``handle.batch`` / ``handle.shard`` cut
        (its ``sequence`` is theirs): its layers must then see that sequence's length."""
        self.agreed: dict[int, Agreed] = {}
        """Layer index -> how that layer's call agreed in this forward: a recomputation of
        the layer agrees the same way (Note [A recomputation replays the agreement])."""
        self.filed: dict[tuple[int, str], object] = {}
        """``(layer index, name)`` -> a value the model filed in this forward's call of that
        layer, handed back to its recomputation (Note [Model values per forward] in
        :mod:`hp_cp_torch.model.runner`)."""

    def __repr__(self) -> str:
        pad = self.sequence.padding
        return f"ForwardRecord(#{self.number}, padding={pad}, layers run={self.last_layer + 1})"


class ForwardRecords:
    """A handle's records: which one each layer call reads (Note [Records per forward]).

    Args:
        sequence: the handle's builder record (what ``handle.shard`` / ``handle.batch``
            recorded last), copied into each new forward's record unless the backend
            names the batch the forward runs on.
    """

    def __init__(self, sequence: ShardedSequence) -> None:
        self.builder = sequence
        self._numbers = itertools.count(1)
        self._scopes: list[ForwardRecord | None] = []
        self._recomputing: list[bool] = []
        self._implicit: ForwardRecord | None = None
        self._live: weakref.WeakSet[ForwardRecord] = weakref.WeakSet()

    def start(self, first_layer: int = 0, sequence: ShardedSequence | None = None) -> ForwardRecord:
        """The record an original (not recomputed) forward entering at ``first_layer`` runs
        under: the current one while its layers still run in order, else a new one made from
        ``sequence`` (the batch the backend found the forward's inputs to belong to) or a
        copy of the builder record."""
        current = self._implicit
        if current is not None and first_layer > current.last_layer and sequence is None:
            return current
        record = ForwardRecord(
            next(self._numbers), (sequence if sequence is not None else self.builder).copy()
        )
        record.cut = sequence is not None
        self._implicit = record
        self._live.add(record)
        return record

    def enter(self, record: ForwardRecord | None, recomputing: bool = False) -> None:
        """Open a scope: layer calls read ``record`` until the matching :meth:`exit`
        (``None``: a scope that found no record; its layers raise if they need one);
        ``recomputing``: the calls re-run a forward's layers in its backward."""
        self._scopes.append(record)
        self._recomputing.append(bool(recomputing))

    def exit(self) -> None:
        """Close the innermost scope."""
        if self._scopes:
            self._scopes.pop()
            self._recomputing.pop()

    @property
    def recomputing(self) -> bool:
        """Whether the innermost scope re-runs a forward's layers (activation
        recomputation): its layers agree as they did in that forward."""
        return bool(self._recomputing) and self._recomputing[-1]

    @property
    def scoped(self) -> bool:
        """Whether a scope is open (the backend placed the current layer calls)."""
        return bool(self._scopes)

    @property
    def current(self) -> ForwardRecord | None:
        """The record layer calls read now: the innermost scope's, else the latest one."""
        if self._scopes:
            return self._scopes[-1]
        return self._implicit

    def for_layer(self, index: int) -> ForwardRecord | None:
        """The record of a call of layer ``index``: the open scope's (``None`` when that scope
        found none), else :meth:`start` by layer order. Marks the layer as run in it."""
        record = self._scopes[-1] if self._scopes else self.start(index)
        if record is not None:
            record.last_layer = max(record.last_layer, int(index))
        return record

    def owns(self, record: ForwardRecord) -> bool:
        """Whether ``record`` is one of these records and still alive."""
        return record in self._live

    def live(self) -> list[ForwardRecord]:
        """The records still referred to (by a forward's graph, a scope or the latest)."""
        return sorted(self._live, key=lambda r: r.number)

    def clear(self) -> None:
        """Forget every record (``disable_cp``)."""
        for record in list(self._live):
            record.shared.clear()
        self._scopes.clear()
        self._recomputing.clear()
        self._implicit = None

    def unknown(self, layer: int) -> str:
        """The message of a recomputed call of layer ``layer`` whose forward has no record."""
        return (
            f"CP layer {layer} is being recomputed (activation checkpointing) but the forward it "
            "belongs to could not be found: its record (the batch's padding, the selection "
            "other layers share) is reached through the tensors the recomputation is given, "
            "and none of them came from a forward of this model that is still alive. Checkpoint "
            "whole modules (a decoder layer, the model's blocks: torch.utils.checkpoint of a "
            "module call, gradient_checkpointing_enable, checkpoint_wrapper) and give each "
            "forward its own input tensors; see docs/training.md, Activation checkpointing."
        )
