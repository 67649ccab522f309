"""An in-process world of N ranks: one thread per rank, collectives on a shared barrier.

Note [The thread world]
~~~~~~~~~~~~~~~~~~~~~~~
Every collective is one *step* that all ranks enter with the same kind::

    rank 0: post(kind, data) --+                         +-- read peers' data --+
    rank 1: post(kind, data) --+-- barrier 1 --> check --+-- read peers' data --+-- barrier 2
    rank 2: post(kind, data) --+  (all posted)   kinds   +-- read peers' data --+  (all read)

The first barrier says every rank has posted, the second that every rank has read, so the
slots can be reused by the next step. After the first barrier each rank compares the kinds
the ranks posted: ranks in different collectives (one in ``all_gather_bwd`` while its peer is
in ``halo_exchange_bwd``, the backward-order bug) raise :class:`CollectiveMismatchError` on
every rank at once, naming each rank's collective and its sequence number, where a real
process group would hang. A rank that raises aborts the barrier, so its peers leave their
collective with :class:`PeerFailedError` instead of waiting; a rank that never comes (it
skipped a collective) makes its peers time out with the same error. Every step is recorded
in the rank's :meth:`ThreadWorld.trace`, so a test can assert that all ranks ran the same
collectives in the same order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from hp_cp_core.errors import HpCpError

T = TypeVar("T")


class PeerFailedError(HpCpError):
    """A rank left a collective because a peer raised, or never came (timeout)."""


class CollectiveMismatchError(HpCpError):
    """The ranks entered different collectives at the same step (a real group would hang)."""


class ThreadWorld:
    """N ranks in one process; :meth:`run` calls ``fn(rank)`` on one thread per rank.

    Args:
        size: number of ranks (1 or more).
        timeout: seconds a rank waits in a collective for its peers before
            :class:`PeerFailedError` (a peer skipped the collective or hangs).

    The collectives (:meth:`exchange`, :meth:`all_gather`) move any Python objects (arrays of
    any framework): a backend builds its differentiable ops on them, or uses
    :class:`~hp_cp_core.testing.ThreadGroup` (numpy, no autograd) directly.
    """

    def __init__(self, size: int, *, timeout: float = 60.0) -> None:
        if int(size) < 1:
            raise HpCpError(f"ThreadWorld(size={size!r}): expected a positive number of ranks.")
        self.size = int(size)
        self.timeout = float(timeout)
        self._barrier = _Barrier(self.size)
        self._slots: list[tuple[str, Any]] = [("", None)] * self.size
        self._traces: list[list[str]] = [[] for _ in range(self.size)]
        self._failed: list[str] = []
        self._lock = threading.Lock()

    # -- running ranks -------------------------------------------------------------------------
    def run(self, fn: Callable[[int], T], *, return_exceptions: bool = False) -> list[T]:
        """``[fn(0), ..., fn(size - 1)]``, each on its own thread.

        A rank that raises aborts the collectives its peers wait in (they raise
        :class:`PeerFailedError`). Then the first error that is not a peer's abort is re-raised
        (with the rank noted), unless ``return_exceptions``: then each failed rank's exception
        takes its place in the list.
        """
        self._barrier = _Barrier(self.size)
        self._slots = [("", None)] * self.size
        self._failed = []
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - reported by run()
                errors[rank] = exc
                with self._lock:
                    self._failed.append(f"rank {rank} raised {type(exc).__name__}: {exc}")
                self._barrier.abort()

        threads = [
            threading.Thread(target=target, args=(k,), name=f"hp_cp rank {k}", daemon=True)
            for k in range(self.size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if return_exceptions:
            return [e if e is not None else r for r, e in zip(results, errors)]
        failed = [(k, e) for k, e in enumerate(errors) if e is not None]
        for k, exc in sorted(failed, key=lambda ke: isinstance(ke[1], PeerFailedError)):
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on rank {k} of a ThreadWorld of {self.size})")
            raise exc
        return results

    def mesh(self, rank: int) -> ThreadMesh:
        """What a test passes to ``enable_cp`` as the mesh of ``rank``."""
        return ThreadMesh(self, rank)

    # -- collectives ---------------------------------------------------------------------------
    def exchange(self, rank: int, kind: str, messages: Mapping[int, Any]) -> dict[int, Any]:
        """Point-to-point: send ``messages[dst]`` to each ``dst``; return ``{src: message}``
        of what the peers sent to ``rank`` (a rank may send to itself)."""
        posted = self._step(rank, kind, dict(messages))
        return {src: box[rank] for src, box in enumerate(posted) if rank in box}

    def all_gather(self, rank: int, kind: str, value: Any) -> list[Any]:
        """Every rank's ``value``, rank-major."""
        return self._step(rank, kind, value)

    def barrier(self, rank: int, kind: str = "barrier") -> None:
        """Wait until every rank arrived (recorded like a collective)."""
        self._step(rank, kind, None)

    # -- traces --------------------------------------------------------------------------------
    def trace(self, rank: int) -> list[str]:
        """The kinds of the collectives ``rank`` entered, in order (since :meth:`reset_traces`)."""
        return list(self._traces[rank])

    def traces(self) -> list[list[str]]:
        """:meth:`trace` of every rank."""
        return [self.trace(k) for k in range(self.size)]

    def reset_traces(self) -> None:
        for t in self._traces:
            t.clear()

    # -- the step (Note [The thread world]) ----------------------------------------------------
    def _step(self, rank: int, kind: str, payload: Any) -> list[Any]:
        trace = self._traces[rank]
        trace.append(kind)
        seq = len(trace)
        self._slots[rank] = (kind, payload)
        self._wait(rank, kind, seq)
        posted = list(self._slots)
        kinds = [k for k, _ in posted]
        if len(set(kinds)) > 1:
            self._wait(rank, kind, seq)  # every rank saw the kinds before anyone posts again
            who = ", ".join(f"rank {k} in {name!r}" for k, name in enumerate(kinds))
            raise CollectiveMismatchError(
                f"collective #{seq}: the ranks entered different collectives ({who}); every "
                "rank must run the same collectives in the same order (in backward too: see "
                "the order token in the backend guide). A process group would hang here."
            )
        self._wait(rank, kind, seq)
        return [p for _, p in posted]

    def _wait(self, rank: int, kind: str, seq: int) -> None:
        try:
            self._barrier.wait(self.timeout)
        except _Broken as exc:
            with self._lock:
                failed = list(self._failed)
            peers = "; ".join(
                f"rank {k} last entered {t[-1]!r} #{len(t)}" if t else f"rank {k} entered none"
                for k, t in enumerate(self._traces)
                if k != rank
            )
            if failed:
                why = f"a peer failed: {failed[0]}"
            else:
                why = (
                    f"timed out after {self.timeout:g}s: a peer never entered it (it skipped "
                    f"this collective or hangs); {peers}"
                )
            raise PeerFailedError(f"rank {rank} left {kind!r} #{seq}: {why}") from exc


class _Broken(Exception):
    pass


class _Barrier:
    """A reusable barrier whose completed rounds stay completed: :meth:`abort` (a rank
    raised) or a timeout releases only the ranks still waiting in an unfinished round, so a
    rank that was already let through never sees a later failure of a peer."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._arrived = 0
        self._round = 0
        self._broken = False

    def wait(self, timeout: float) -> None:
        with self._cond:
            if self._broken:
                raise _Broken()
            this = self._round
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived = 0
                self._round += 1
                self._cond.notify_all()
                return
            done = self._cond.wait_for(lambda: self._round != this or self._broken, timeout)
            if self._round != this:
                return
            self._broken = True  # a timeout breaks the world for every rank still waiting
            self._cond.notify_all()
            raise _Broken("timeout" if not done else "aborted")

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class ThreadMesh:
    """The mesh of one rank of a :class:`ThreadWorld` (what ``enable_cp`` receives)."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        if not 0 <= rank < world.size:
            raise HpCpError(f"rank {rank} is not in a ThreadWorld of {world.size} ranks.")
        self.world = world
        self.rank = rank

    def __repr__(self) -> str:
        return f"ThreadMesh(rank={self.rank}, size={self.world.size})"
