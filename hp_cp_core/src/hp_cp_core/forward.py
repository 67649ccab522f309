"""``DeepSeekV4CPForward``: one layer forward under CP, as the stages of DESIGN.md section 4."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from hp_cp_core.backend import Backend, Group
from hp_cp_core.collectives import exchange_halos
from hp_cp_core.compression import build_global_compressed_kv_for_cp
from hp_cp_core.config import DeepSeekV4CPConfig, DeepSeekV4CPContext, LayerSpec
from hp_cp_core.errors import PlanError
from hp_cp_core.plan import PlanCache
from hp_cp_core.plugins import Hooks


class DeepSeekV4CPForward:
    """Runs one attention layer on local rows through the hooks and the group's exchanges.

    Args:
        module: the attention layer (handed to every hook).
        hooks: the typed hook facade of the plugin host.
        backend: the module's backend (tensor ops).
        group: the CP group (collectives).
        spec: the layer's :class:`LayerSpec`.
        config: the ``enable_cp`` options.
        cache: where plans are kept (shared by the layers of one ``enable_cp`` call).
    """

    def __init__(
        self,
        module: Any,
        hooks: Hooks,
        backend: Backend,
        group: Group,
        spec: LayerSpec,
        config: DeepSeekV4CPConfig | None = None,
        cache: PlanCache | None = None,
    ) -> None:
        self.module = module
        self.hooks = hooks
        self.backend = backend
        self.group = group
        self.spec = spec
        self.config = config or DeepSeekV4CPConfig()
        self.cache = cache or PlanCache()

    def __call__(
        self, query: Any, key: Any, x: Any, qr: Any, *, cu_seqlens: Any = None, **extra: Any
    ) -> Any:
        call = self.context(self.backend.num_rows(x), cu_seqlens, extra)
        ori_kv = self.hooks.extract_ori_kv(self.module, key)
        ori_ext, halo_x = exchange_halos(self.group, self.backend, ori_kv, x, call.plan)
        cmp_kv_global, cmp_idx_global = self.global_compressed_kv(x, halo_x, call)
        call = call.replace(cmp_kv_global=cmp_kv_global, cmp_idx_global=cmp_idx_global)
        return self.hooks.run_attention(self.module, query, ori_ext, x, qr, call)

    def global_compressed_kv(self, x: Any, halo_x: Any, call: DeepSeekV4CPContext):
        """Main compressed KV and indexer keys of every rank, in global slot order."""
        if self.spec.compress_ratio == 0:
            return None, None
        owned = [self.hooks.compress_main(self.module, x, halo_x, call)]
        if self.spec.has_indexer:
            owned.append(self.hooks.compress_indexer(self.module, x, halo_x, call))
        gathered = build_global_compressed_kv_for_cp(self.group, self.backend, owned, call.plan)
        return gathered[0], (gathered[1] if len(gathered) > 1 else None)

    def local_positions(self, n_local: int, cu_seqlens: Any = None) -> np.ndarray:
        """Default RoPE positions of this rank's rows (used when the caller passes none)."""
        cu = None if cu_seqlens is None else np.asarray(cu_seqlens).astype(np.int64).reshape(-1)
        return self._plan(n_local, cu).positions

    def _plan(self, n_local: int, cu: np.ndarray | None) -> Any:
        return self.cache.get(
            rank=self.group.rank,
            cp_size=self.group.size,
            spec=self.spec,
            layout_kind=self.config.layout,
            total_rows=n_local * self.group.size,
            cu_seqlens=cu,
        )

    def context(self, n_local: int, cu_seqlens: Any, extra: dict[str, Any]) -> DeepSeekV4CPContext:
        """Validate the local inputs (on every rank, before any exchange) and fetch the plan."""
        cu = None if cu_seqlens is None else np.asarray(cu_seqlens).astype(np.int64).reshape(-1)
        cp, rank = self.group.size, self.group.rank
        if self.config.check_inputs_across_ranks and cp > 1:
            digest = 0 if cu is None else zlib.crc32(cu.tobytes())
            meta = self.group.all_gather_meta(np.array([n_local, digest], dtype=np.int64))
            if np.any(meta != meta[0]):
                raise PlanError(
                    f"CP ranks were given inconsistent inputs: local rows per rank "
                    f"{meta[:, 0].tolist()}, cu_seqlens digests {meta[:, 1].tolist()}. Expected "
                    "every rank to pass the same number of local rows (use handle.shard) and "
                    "the same global cu_seqlens."
                )
        total = n_local * cp
        if cu is not None and int(cu[-1]) != total:
            raise PlanError(
                f"cu_seqlens ends at {int(cu[-1])} but the ranks hold {n_local} x {cp} = {total} "
                "rows. Pass the global cu_seqlens (the same on every rank) and each rank's "
                "local rows from handle.shard(x, 0)."
            )
        plan = self._plan(n_local, cu)
        return DeepSeekV4CPContext(
            cp_rank=rank,
            cp_size=cp,
            spec=self.spec,
            plan=plan,
            config=self.config,
            cu_seqlens=cu,
            ops=self.backend,
            extra=extra,
        )
