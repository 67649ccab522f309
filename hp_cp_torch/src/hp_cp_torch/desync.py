"""The desync report: where every CP rank last entered a collective, for the error raised
when one of them fails or times out.

Note [Desync report]
~~~~~~~~~~~~~~~~~~~~
A CP collective that times out means the ranks no longer run the same sequence of
collectives: a peer failed, or skipped a forward or backward (a user bug, or a hang of its
own). The timeout alone says where *this* rank waits, not where the others are. So each
rank numbers the collectives it enters (forward and backward, per CP group) and, before
entering one, writes one key of the process group's store (a ``PrefixStore`` over the
default ``TCPStore``)::

    hp_cp/desync/<global ranks>/<rank>  =  "all_gather backward #8 (layer 12)"

    rank 0:  ... halo_exchange backward #7 (layer 12) ----- waits (timeout) --> raises
    rank 1:  ... halo_exchange backward #7 ... all_gather backward #8 (layer 12) waits
    rank 2:  ... same as rank 1
             store: {0: "halo_exchange backward #7 (layer 12)",
                     1: "all_gather backward #8 (layer 12)", 2: ...}

When the collective fails, the rank reads its peers' keys (``check`` first, so a missing
key never blocks) and the error says ``rank 0 waits in halo_exchange backward #7
(layer 12); ranks 1-2 last entered all_gather backward #8 (layer 12)``. Ranks that run the
same program enter collectives with the same numbers, so the numbers tell who is behind.
Numbers and layers count per ``enable_cp`` handle (layer i = the handle's i-th attention
layer); a peer whose process is gone, or a store that cannot be reached, is reported as
"unknown". Cost: one ``store.set`` (a round trip to the store's host) per collective
entered; ``hp-cp bench`` measures it (``desync_record_us``).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

KEY_PREFIX = "hp_cp/desync"


def group_store(global_ranks: Sequence[int]) -> Any:
    """A store shared by the ranks of one CP group (``None`` when there is none to use)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
    return dist.PrefixStore(f"{KEY_PREFIX}/{'-'.join(map(str, global_ranks))}/", store)


RECENT = 1024
"""How many entered collectives :attr:`CollectiveLog.recent` keeps."""


class CollectiveLog:
    """This rank's numbered collectives in one CP group, published for the desync report.

    Args:
        rank: this rank in the CP group. size: the group size.
        store: a ``torch.distributed.Store`` shared by the group's ranks, or ``None`` (then
            the report names only this rank's own collective).
    """

    def __init__(self, rank: int, size: int, store: Any) -> None:
        self.rank, self.size = rank, size
        self.store = store
        self.seq = 0
        self.layer: int | None = None
        """The layer whose CP forward runs now (set by :class:`InLayer`)."""
        self.recent: collections.deque[str] = collections.deque(maxlen=RECENT)
        """The last collectives entered, oldest first (the contract suite compares ranks)."""
        self._publish("")  # a new group: nothing entered yet (clears an older handle's record)

    def _publish(self, where: str) -> None:
        if self.store is not None:
            try:
                self.store.set(str(self.rank), where)
            except (RuntimeError, OSError):  # the store's host is gone: report without it
                self.store = None

    def enter(self, name: str, layer: int | None) -> str:
        """Number the collective ``name`` this rank is entering and publish it."""
        self.seq += 1
        where = f"{name} #{self.seq}" + ("" if layer is None else f" (layer {layer})")
        self._publish(where)
        self.recent.append(where)
        return where

    def peers(self) -> dict[int, str | None]:
        """What each other rank last entered (``None``: nothing recorded, or unreachable)."""
        out: dict[int, str | None] = {}
        for peer in range(self.size):
            if peer == self.rank:
                continue
            out[peer] = None
            if self.store is None:
                continue
            try:
                if self.store.check([str(peer)]):
                    out[peer] = self.store.get(str(peer)).decode()
            except (RuntimeError, OSError):
                self.store = None
        return out

    def report(self, where: str) -> str:
        """``rank 0 waits in <where>; ranks 1-3 last entered <...>``."""
        groups: dict[str | None, list[int]] = {}
        for peer, last in self.peers().items():
            groups.setdefault(last, []).append(peer)
        parts = [f"rank {self.rank} waits in {where}"]
        for last, ranks in groups.items():
            who = _ranks(ranks)
            if last:
                parts.append(f"{who} last entered {last}")
            elif last == "":
                parts.append(f"{who} entered no CP collective of this group yet")
            else:
                parts.append(
                    f"{who}: unknown (no record: its CP group was never created, or the "
                    "store cannot be reached)"
                )
        return "; ".join(parts)


class InLayer:
    """A layer's CP forward that sets ``log.layer`` to the layer's index while it runs.

    The torch backend installs each layer with one, so the collectives of that forward (and
    the backward ones, which the autograd functions record at forward time) carry the layer.
    Everything else is the wrapped ``DeepSeekV4CPForward``'s.
    """

    def __init__(self, cp_forward: Any, log: CollectiveLog, index: int) -> None:
        self._cp_forward, self._log, self.layer_index = cp_forward, log, index

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self._cp_forward, name)

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        previous, self._log.layer = self._log.layer, self.layer_index
        try:
            return fn(*args, **kwargs)
        finally:
            self._log.layer = previous

    def agree(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._cp_forward.agree, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._cp_forward, *args, **kwargs)


def _ranks(ranks: list[int]) -> str:
    """``rank 2``, ``ranks 1-3``, ``ranks 0, 3-5``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for k in ranks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return "ranks " + ", ".join(
        str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs
    )
