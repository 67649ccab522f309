"""The backend author's kit: test CP at cp 1..8 in one process, without a distributed runtime.

* :class:`ThreadWorld`: N ranks on threads; ``world.run(fn)`` calls ``fn(rank)`` on each and
  the collectives between them have real semantics (every rank must enter them, in the same
  order; a rank that raises or skips one makes its peers raise, never hang). Each rank's
  sequence of collectives is recorded (``world.trace(rank)``).
* :class:`ThreadGroup`: the core's ``Group`` protocol on a world, on numpy, with the forward
  and backward of both layer exchanges for a backend to wrap in its framework's autograd.
* :mod:`hp_cp_core.testing.contract`: the contract suite every backend passes, as a pytest
  plugin (``pytest -p hp_cp_core.testing.contract``; needs ``hp-cp-core[testing]``).

Nothing here imports a framework or pytest. See ``docs/testing-a-backend.md``.
"""

from __future__ import annotations

import numpy as np

from hp_cp_core.testing.group import ThreadGroup
from hp_cp_core.testing.world import (
    CollectiveMismatchError,
    PeerFailedError,
    ThreadMesh,
    ThreadWorld,
)

__all__ = [
    "CollectiveMismatchError",
    "PeerFailedError",
    "ThreadGroup",
    "ThreadMesh",
    "ThreadWorld",
    "rel_err",
]


def rel_err(got, want) -> float:
    """``max |got - want| / max |want|`` (the absolute difference when ``want`` is all zero):
    how far a CP result is from the single-device one, in units of the result's scale."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: got {got.shape}, want {want.shape}")
    if not want.size:
        return 0.0
    diff = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    return diff / scale if scale else diff
