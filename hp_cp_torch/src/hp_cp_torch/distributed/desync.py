"""The desync report: where every CP rank last entered a collective, for the error raised
when one of them fails or times out.

Note [Desync report]
~~~~~~~~~~~~~~~~~~~~
A CP collective that times out means the ranks no longer run the same sequence of
collectives: a peer failed, or skipped a forward or backward (a user bug, or a hang of its
own). The timeout alone says where *this* rank waits, not where the others are. So each
rank numbers the collectives it enters (forward and backward, per CP group) and keeps them
in memory, in a bounded ring (:attr:`CollectiveLog.recent`, a flight recorder): nothing
touches the store while all goes well. A rank *publishes* its last entry to one key of the
process group's store (a ``PrefixStore`` over the default ``TCPStore``, scoped by the
process group's name and the handle's number on it) only when

* one of its CP collectives fails or times out (before it reads its peers' keys),
* an exception leaves one of its CP layers' forwards, or
* its handle is closed (``disable_cp``): a rank that skipped a backward and moved on
  still tells the ranks left waiting where it stopped::

    hp_cp/desync/<group name>.<handle>/<rank>  =  "all_gather backward #8 (layer 12)"

    rank 0:  ... halo_exchange backward #7 (layer 12) ----- waits (timeout) --> publishes,
    rank 1:  ... halo_exchange backward #7 ... all_gather backward #8 (layer 12) waits, times
    rank 2:  ... same as rank 1                                     out, publishes
             store: {0: "halo_exchange backward #7 (layer 12)",
                     1: "all_gather backward #8 (layer 12)", 2: ...}

The failing rank then reads its peers' keys, waiting for the missing ones at most
:data:`READ_WAIT_S` in all (a peer timing out in the same collective publishes a moment
later), and the error says ``rank 0 waits in halo_exchange backward #7 (layer 12); ranks 1-2
last entered all_gather backward #8 (layer 12)``. Ranks that run the same program enter
collectives with the same numbers, so the numbers tell who is behind. Numbers and layers
count per ``enable_cp`` handle (layer i = the handle's i-th attention layer); a peer that
published nothing within the wait (its process is gone, or it is stuck outside CP with its
handle open), or a store that cannot be reached, is reported as "unknown". Cost while all
goes well: a deque append per collective; none at the store (``hp-cp bench`` counts it:
``store_ops_per_step``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

KEY_PREFIX = "hp_cp/desync"

READ_WAIT_S = 5.0
"""How long a failing rank waits, in all, for the peers' records it does not find."""


def group_store(global_ranks: Sequence[int], scope: str = "") -> Any:
    """A store shared by the ranks of one CP group (``None`` when there is none to use).

    ``scope`` (the process group's name and the handle's number on it, the same on every
    rank) keeps one handle's records apart from an earlier one's on the same ranks."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
    ranks = "-".join(map(str, global_ranks))
    return dist.PrefixStore(
        f"{KEY_PREFIX}/{scope}/{ranks}/" if scope else f"{KEY_PREFIX}/{ranks}/", store
    )


RECENT = 1024
"""How many entered collectives :attr:`CollectiveLog.recent` keeps (the flight recorder)."""


class CollectiveLog:
    """This rank's numbered collectives in one CP group, in memory; published on failure.

    Args:
        rank: this rank in the CP group. size: the group size.
        store: a ``torch.distributed.Store`` shared by the group's ranks, or ``None`` (then
            the report names only this rank's own collective).
        read_wait_s: the bounded wait for the peers' records (:data:`READ_WAIT_S`).
    """

    def __init__(self, rank: int, size: int, store: Any, read_wait_s: float = READ_WAIT_S) -> None:
        self.rank, self.size, self.store, self.read_wait_s = rank, size, store, read_wait_s
        self.seq = 0
        self.layer: int | None = None
        """The layer whose CP forward runs now (set by :class:`InLayer`)."""
        self.recent: collections.deque[str] = collections.deque(maxlen=RECENT)
        """The last collectives entered, oldest first (the flight recorder; the contract
        suite compares ranks)."""

    @property
    def last(self) -> str:
        """The last collective entered (``""``: none yet)."""
        return self.recent[-1] if self.recent else ""

    def publish(self) -> None:
        """Write this rank's last entry to the store, for its peers' reports (on failure)."""
        if self.store is not None:
            try:
                self.store.set(str(self.rank), self.last)
            except (RuntimeError, OSError):  # the store's host is gone: report without it
                self.store = None

    def enter(self, name: str, layer: int | None) -> str:
        """Number the collective ``name`` this rank is entering and record it (in memory)."""
        self.seq += 1
        where = f"{name} #{self.seq}" + ("" if layer is None else f" (layer {layer})")
        self.recent.append(where)
        return where

    def peers(self) -> dict[int, str | None]:
        """What each other rank last entered (``None``: no record within the wait, or the
        store cannot be reached); publishes this rank's record first."""
        self.publish()
        out: dict[int, str | None] = {p: None for p in range(self.size) if p != self.rank}
        missing = set(out)
        deadline = time.monotonic() + self.read_wait_s
        while missing and self.store is not None:
            try:
                for peer in sorted(missing):
                    if self.store.check([str(peer)]):
                        out[peer] = self.store.get(str(peer)).decode()
                        missing.discard(peer)
            except (RuntimeError, OSError):
                self.store = None
                break
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
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
    Everything else is the wrapped ``CPForward``'s.
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
        except BaseException:
            self._log.publish()  # this rank leaves the CP sequence here: tell the peers
            raise
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
