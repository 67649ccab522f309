"""Which forward a CP layer call belongs to, on torch (Note [Records per forward] in
:mod:`hp_cp_core.records`).

Note [Finding a recomputed forward's record]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Activation checkpointing re-runs a region of the model inside the backward, with the
tensors the region was given in its forward: the very objects (``use_reentrant=False``,
``checkpoint_wrapper``) or detached views of them (``use_reentrant=True``), which share
their storage. So the record travels on those storages::

    forward:    block k (h_k) ──> tag storage(h_k) with record A
    fwd B ...   block k (h'_k) ─> tag storage(h'_k) with record B
    backward A: recompute block k (h_k, or h_k.detach()) ──> storage(h_k) ──> record A

:func:`install_forward_scopes` puts a forward pre-hook (and an always-called forward hook)
on the module ``enable_cp`` was given and on every module between it and a CP layer; each CP
layer's installed forward does the same itself (:class:`CallScope`), so a layer keeps its
hooks as they were. In a forward (not inside a backward), the outermost hooked call starts the
forward's record (:meth:`~hp_cp_core.records.ForwardRecords.start`: from the batch its
tensors were cut by, ``handle.batch`` / ``handle.shard``, when it is given one), and every
hooked call tags the storages of its tensor arguments with it. Inside a backward a hooked
call is a recomputation: the storages of its arguments name the record, when exactly one live
record tagged one of them alone; the scope holds it until the call returns.

A forward's record lives as long as its graph: the autograd nodes of the hooked calls'
outputs keep it, and so do the storages of arguments that need a gradient (what a
reentrant checkpoint saves, its forward having built no graph); a storage refers weakly to
the others (a rotary cache
or a mask that many forwards share names no forward). A storage passed to several live
forwards names none of them; when no argument names a record, the layers of that
recomputation raise the same ``HpCpError`` on every rank (the ranks run the same program).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hp_cp_core.api import cp_state_not_copyable
from hp_cp_core.padding import ShardedSequence
from hp_cp_core.records import ForwardRecord, ForwardRecords

FORWARDS_ATTR = "_hp_cp_forwards"
"""The attribute of an untyped storage holding the records of the forwards it was given to."""
BATCH_ATTR = "_hp_cp_batch"
"""The attribute of an untyped storage holding the padding records of the batches cut into it."""
STRONG_PER_STORAGE = 8
"""Records one storage keeps alive at most (the oldest let go first): a tensor that needs a
gradient and is given to many forwards (rare) does not keep them all."""


class _Tags:
    """The records one storage was given to: kept (``strong``) or referred to (``weak``)."""

    def __init__(self) -> None:
        self.strong: list[ForwardRecord] = []
        self.weak: weakref.WeakSet[ForwardRecord] = weakref.WeakSet()

    def add(self, record: ForwardRecord, keep: bool) -> None:
        if keep:
            if record not in self.strong:
                self.strong.append(record)
                del self.strong[:-STRONG_PER_STORAGE]
        else:
            self.weak.add(record)

    def of(self, records: ForwardRecords) -> set[ForwardRecord]:
        return {r for r in (*self.strong, *self.weak) if records.owns(r)}


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists and dicts; a model output's fields)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except Exception:  # noqa: BLE001 - no storage to carry a record (meta, fake, a subclass)
        return None


def mark_batch(tensor: Any, records: ForwardRecords, sequence: ShardedSequence) -> None:
    """Note that ``tensor`` (an input ``handle.batch`` / ``handle.shard`` cut) belongs to the
    batch of padding record ``sequence``: a forward given it runs under that record."""
    storage = _storage(tensor)  # None for anything but a tensor with a storage
    if storage is None:
        return
    marks = getattr(storage, BATCH_ATTR, None)
    if marks is None:
        marks = weakref.WeakKeyDictionary()
        setattr(storage, BATCH_ATTR, marks)
    marks[records] = sequence.copy()


def batch_of(args: Any, records: ForwardRecords) -> ShardedSequence | None:
    """The padding record of the batch one of ``args``' tensors was cut from, if any."""
    for t in tensors_in(args):
        marks = getattr(_storage(t), BATCH_ATTR, None)
        if marks is not None and records in marks:
            return marks[records]
    return None


def tag(args: Any, record: ForwardRecord) -> None:
    """Tag the storages of ``args``' tensors with ``record`` (kept by those needing a
    gradient: Note [Finding a recomputed forward's record])."""
    for t in tensors_in(args):
        storage = _storage(t)
        if storage is None:
            continue
        tags = getattr(storage, FORWARDS_ATTR, None)
        if tags is None:
            tags = _Tags()
            setattr(storage, FORWARDS_ATTR, tags)
        tags.add(record, keep=t.requires_grad and not isinstance(t, nn.Parameter))


def find(args: Any, records: ForwardRecords) -> ForwardRecord | None:
    """The one live record an argument's storage names alone; with no argument naming one,
    the only live record; else ``None`` (arguments naming different records, or several
    live forwards and nothing to tell them apart)."""
    named: set[ForwardRecord] = set()
    for t in tensors_in(args):
        tags = getattr(_storage(t), FORWARDS_ATTR, None)
        if tags is None:
            continue
        mine = tags.of(records)
        if len(mine) == 1:
            named |= mine
    if len(named) == 1:
        return next(iter(named))
    if not named:  # nothing names one: unambiguous only while one forward is alive
        live = records.live()
        return live[0] if len(live) == 1 else None
    return None


def keep_with_graph(out: Any, record: ForwardRecord) -> None:
    """Keep ``record`` alive as long as the graph of ``out``'s tensors (on their autograd
    nodes): a forward whose backward is still to come always has its record."""
    for t in tensors_in(out):
        if t.grad_fn is not None:
            t.grad_fn.metadata[FORWARDS_ATTR] = record


def _in_backward() -> bool:
    """Whether this thread runs inside an autograd backward (a recomputation runs there)."""
    return torch._C._current_graph_task_id() != -1


def _first_layers(root: nn.Module, layers: list[nn.Module]) -> dict[nn.Module, int]:
    """Every module from ``root`` down to a CP layer (the layers included), with the index of
    the first CP layer under it."""
    index = {id(layer): k for k, layer in enumerate(layers)}
    first: dict[int, tuple[nn.Module, int]] = {}

    def walk(module: nn.Module) -> int | None:
        best = index.get(id(module))
        for child in module.children():
            below = walk(child)
            if below is not None and (best is None or below < best):
                best = below
        if best is not None:
            first[id(module)] = (module, best)
        return best

    walk(root)
    for k, layer in enumerate(layers):  # a layer outside the root's tree: itself
        first.setdefault(id(layer), (layer, k))
    return {m: k for m, k in first.values()}


class CallScope:
    """The scope of one module's calls: which forward's record they and the CP layers under
    them read (Note [Finding a recomputed forward's record]).

    Args:
        records: the handle's records.
        first_layer: the index of the first CP layer under the module.
    """

    def __init__(self, records: ForwardRecords, first_layer: int) -> None:
        self.records, self.first_layer = records, first_layer

    def enter(self, args: Any, kwargs: Any) -> None:
        """Open the call's scope: a recomputation's found record, an inner call's outer
        scope, or the forward's record (started here, for the outermost call); tags the
        arguments' storages in a forward."""
        records, given = self.records, (args, kwargs)
        if _in_backward():  # a recomputation: its forward's record, or the enclosing one
            found = find(given, records)
            found = found if found is not None or not records.scoped else records.current
            records.enter(found, recomputing=True)
            return
        if records.scoped:
            record = records.current
        else:
            record = records.start(self.first_layer, batch_of(given, records))
        if record is not None:
            tag(given, record)
        records.enter(record)

    def exit(self, out: Any) -> None:
        """Close the call's scope; in a forward, the outputs' graph keeps the record."""
        record = self.records.current
        if record is not None and not _in_backward():
            keep_with_graph(out, record)
        self.records.exit()

    def run(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in this scope (a CP layer's installed forward)."""
        self.enter(args, kwargs)
        out = None
        try:
            out = fn(*args, **kwargs)
            return out
        finally:
            self.exit(out)


class _Hook:
    """A module hook running ``fn`` (a :class:`CallScope` step) outside ``torch.compile``;
    like the installed forward, it refuses to be pickled or copied (the module runs under
    CP: :func:`hp_cp_core.api.cp_state_not_copyable`, naming the CP layer below it)."""

    def __init__(self, fn: Callable[..., None], layer_type: str, out: bool = False) -> None:
        self.fn, self.layer_type, self.out = fn, layer_type, out

    def __call__(self, module: nn.Module, args: Any, kwargs: Any, *out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self.out:
            self.fn(out[0])
        else:
            self.fn(args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise cp_state_not_copyable(self.layer_type)


def install_forward_scopes(
    root: nn.Module, layers: list[nn.Module], records: ForwardRecords
) -> Callable[[], None]:
    """Hook ``root`` and every module between it and a CP layer so that each layer call reads
    its own forward's record (Note [Finding a recomputed forward's record]); returns the undo.
    The CP layers themselves are not hooked: their installed forward runs its
    :class:`CallScope` (:meth:`TorchBackend.install`)."""
    handles = []
    own = {id(layer) for layer in layers}
    for module, first_layer in _first_layers(root, layers).items():
        if id(module) in own:
            continue
        scope = CallScope(records, first_layer)
        layer_type = type(layers[first_layer]).__name__
        before, after = _Hook(scope.enter, layer_type), _Hook(scope.exit, layer_type, out=True)
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))

    def undo() -> None:
        for h in handles:
            h.remove()

    return undo
