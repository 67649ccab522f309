"""A backend written against the 0.1 backend API, kept as it was (entry points ``hp_cp:
legacy`` and ``hp_cp.contract: legacy``; it claims only :class:`LegacyToyAttention`).

Its group has the 0.1 ``Group`` protocol: ``exchange_rows(items) -> list`` and
``all_gather_rows(tensor) -> tensor``, no ``begin_order`` / ``end_order``, no tokens, and the
plugin implements no ``hp_cp_backend_api`` hook (it predates it). hp-cp-core 0.2 adapts it
with placeholder tokens and a ``DeprecationWarning`` (numpy is forward only, so that is
correct; :mod:`hp_cp_core.versions`). The layer and the stage hooks are the fake's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hp_cp_core import HpCpError, hookimpl
from hp_cp_core.testing import ThreadGroup, ThreadMesh
from hp_cp_fake.fake_backend import (  # noqa: F401 - the stage hooks, registered from here
    FakeBackend,
    ToyAttention,
    hp_cp_compress_indexer,
    hp_cp_compress_main,
    hp_cp_extract_ori_kv,
    hp_cp_layer_spec,
    hp_cp_run_attention,
)


class LegacyToyAttention(ToyAttention):
    """The fake's layer, owned by this backend."""


class LegacyGroup:
    """The 0.1 ``Group``: collectives without order tokens (on the kit's thread world)."""

    def __init__(self, mesh: ThreadMesh) -> None:
        self._world = ThreadGroup(mesh)
        self.rank = self._world.rank
        self.size = self._world.size

    def exchange_rows(self, items: Sequence[tuple[np.ndarray, Any]]) -> list[np.ndarray]:
        return self._world.exchange_rows_np([t for t, _ in items], [p for _, p in items])

    def all_gather_rows(self, tensor: np.ndarray) -> np.ndarray:
        return self._world.all_gather_rows_np(tensor)

    def all_gather_dim(self, tensor: np.ndarray, dim: int) -> np.ndarray:
        return self._world.all_gather_dim(tensor, dim)

    def all_gather_meta(self, values: np.ndarray) -> np.ndarray:
        return self._world.all_gather_meta(values)

    def stats(self) -> dict[str, Any]:
        return self._world.stats()


class LegacyBackend(FakeBackend):
    name = "legacy"

    def group(self, mesh: Any) -> Any:
        if not isinstance(mesh, ThreadMesh):
            raise HpCpError(f"the legacy backend needs a ThreadMesh, got {type(mesh).__name__}.")
        return self.make_group(mesh)

    def make_group(self, mesh: ThreadMesh) -> Any:
        return LegacyGroup(mesh)


BACKEND = LegacyBackend()


@hookimpl
def hp_cp_backend(module: Any) -> Any:
    return BACKEND if isinstance(module, LegacyToyAttention) else None
