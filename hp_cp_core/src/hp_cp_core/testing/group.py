"""The core's ``Group`` protocol on a :class:`~hp_cp_core.testing.ThreadWorld`, on numpy.

:class:`ThreadGroup` runs the layer exchanges forward *and* backward on numpy arrays, and
counts them in the one stats schema (:mod:`hp_cp_core.stats`). As a ``Group`` it is
forward-only (numpy records no backward: its order tokens are ``None``); a backend for a
framework with autograd wraps the four numpy methods in its own differentiable ops::

    forward:  outs = group.exchange_rows_np(arrays, plans)       # [recv ; local] per item
    backward: grads = group.exchange_rows_backward_np(douts, plans)
    forward:  gathered = group.all_gather_rows_np(array)         # [size * cap, F]
    backward: grad = group.all_gather_rows_backward_np(dgathered)  # this rank's [cap, F]

Backward must be called on every rank, also where a tensor has 0 rows or nothing was sent
(the world checks that all ranks enter the same collective; see Note [The thread world]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hp_cp_core.errors import HpCpError
from hp_cp_core.stats import (
    ALL_GATHER,
    ALL_GATHER_BWD,
    HALO_EXCHANGE,
    HALO_EXCHANGE_BWD,
    META,
    GroupStats,
    count,
    new_stats,
)
from hp_cp_core.testing.world import ThreadMesh, ThreadWorld


class ThreadGroup:
    """One rank's CP group of a :class:`ThreadWorld` (``mesh`` a :class:`ThreadMesh`)."""

    def __init__(self, mesh: ThreadMesh) -> None:
        if not isinstance(mesh, ThreadMesh):
            raise HpCpError(
                f"a ThreadGroup needs a ThreadMesh (world.mesh(rank)), got {type(mesh).__name__}."
            )
        self.world: ThreadWorld = mesh.world
        self.rank = mesh.rank
        self.size = mesh.world.size
        self._stats = new_stats()

    # -- numpy forward / backward of the layer exchanges -------------------------------------
    def exchange_rows_np(
        self, arrays: Sequence[np.ndarray], plans: Sequence[Any]
    ) -> list[np.ndarray]:
        """Halo exchange of several arrays in one message per peer: per item
        ``[rows received, in source-rank order ; the array]`` (``Group.exchange_rows``)."""
        arrays = [np.asarray(a) for a in arrays]
        messages = {}
        for dst in range(self.size):
            if dst != self.rank and any(p.send_rows[dst].size for p in plans):
                messages[dst] = [a[p.send_rows[dst]] for a, p in zip(arrays, plans)]
        received = self.world.exchange(self.rank, HALO_EXCHANGE, messages)
        outs = []
        for i, (a, p) in enumerate(zip(arrays, plans)):
            parts = [received[s][i] for s in range(self.size) if p.recv_counts[s]]
            outs.append(np.concatenate([*parts, a]) if parts else a)
        count(self._stats, HALO_EXCHANGE, _nbytes(messages), _nbytes(received))
        return outs

    def exchange_rows_backward_np(
        self, grads: Sequence[np.ndarray], plans: Sequence[Any]
    ) -> list[np.ndarray]:
        """Gradient of :meth:`exchange_rows_np`: the received rows' gradient goes back to its
        owners and is added to the gradient of the rows they sent."""
        grads = [np.asarray(g) for g in grads]
        messages: dict[int, list[np.ndarray]] = {}
        locals_ = []
        for i, (g, p) in enumerate(zip(grads, plans)):
            start = 0
            for src in range(self.size):
                n = int(p.recv_counts[src])
                if n:
                    messages.setdefault(src, [g[:0]] * len(plans))[i] = g[start : start + n]
                start += n
            locals_.append(g[start:].copy())
        received = self.world.exchange(self.rank, HALO_EXCHANGE_BWD, messages)
        for src, parts in received.items():
            for i, (part, p) in enumerate(zip(parts, plans)):
                if part.shape[0]:
                    np.add.at(locals_[i], p.send_rows[src], part)
        count(self._stats, HALO_EXCHANGE_BWD, _nbytes(messages), _nbytes(received))
        return locals_

    def all_gather_rows_np(self, array: np.ndarray) -> np.ndarray:
        """``[cap, F]`` of every rank into ``[size * cap, F]``, rank-major."""
        array = np.asarray(array)
        parts = self.world.all_gather(self.rank, ALL_GATHER, array)
        sent = array.nbytes if self.size > 1 else 0  # one copy out, size - 1 in
        count(self._stats, ALL_GATHER, sent, array.nbytes * (self.size - 1))
        return np.concatenate(parts)

    def all_gather_rows_backward_np(self, grad: np.ndarray) -> np.ndarray:
        """Gradient of :meth:`all_gather_rows_np`: the sum over ranks of this rank's rows."""
        grad = np.asarray(grad)
        cap = grad.shape[0] // self.size
        parts = self.world.all_gather(self.rank, ALL_GATHER_BWD, grad)
        mine = sum(p[self.rank * cap : (self.rank + 1) * cap] for p in parts)
        share = grad.nbytes * (self.size - 1) // self.size
        count(self._stats, ALL_GATHER_BWD, share, share)
        return np.asarray(mine, dtype=grad.dtype)

    # -- the Group protocol (numpy, forward only) ----------------------------------------------
    def begin_order(self, anchor: Any) -> Any:
        """numpy records no backward: no order token."""
        return None

    def exchange_rows(self, items: Sequence[tuple[Any, Any]], token: Any) -> tuple[list, Any]:
        return self.exchange_rows_np([t for t, _ in items], [p for _, p in items]), token

    def all_gather_rows(self, tensor: Any, token: Any) -> tuple[np.ndarray, Any]:
        return self.all_gather_rows_np(tensor), token

    def end_order(self, output: Any, token: Any) -> Any:
        return output

    def all_gather_dim(self, tensor: Any, dim: int) -> np.ndarray:
        parts = self.world.all_gather(self.rank, "all_gather_dim", np.asarray(tensor))
        return np.concatenate(parts, axis=dim)

    def all_gather_meta(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.int64)
        parts = self.world.all_gather(self.rank, META, values)
        sent = values.nbytes if self.size > 1 else 0
        count(self._stats, META, sent, values.nbytes * (self.size - 1))
        return np.stack(parts)

    def stats(self) -> GroupStats:
        return {
            "bytes_sent": self._stats["bytes_sent"],
            "bytes_recv": self._stats["bytes_recv"],
            "collectives": dict(self._stats["collectives"]),
        }


def _nbytes(box: dict[int, list[np.ndarray]]) -> int:
    return int(sum(a.nbytes for parts in box.values() for a in parts))
