"""hp_cp_core: backend-agnostic context parallelism for DeepSeek's sparse attention (V4, V4.1,
V3.2 / GLM-5).

Public entry points: :func:`enable_cp` (every stack's one entry point), :func:`disable_cp`,
:class:`CPConfig`, ``handle.batch`` (:class:`CPBatch`, planned by :func:`plan_batch`),
:data:`hookimpl` and :data:`BACKEND_API` (for backend plugins), :class:`LayerSpec`,
:class:`CPContext`, :class:`CPForward`, :func:`plan_sharing` (which layer owns each shared
compressed KV, index-key set, selection and candidate-block set), and the errors under
:class:`HpCpError`. ``DeepSeekV4CPConfig``, ``DeepSeekV4CPContext`` and
``DeepSeekV4CPForward`` are the 0.2 names of the same classes (plain aliases).
"""

from __future__ import annotations

import pluggy

from hp_cp_core.api import CPHandle, disable_cp, enable_cp
from hp_cp_core.backend import Backend, Group
from hp_cp_core.batch import (
    BatchPlan,
    CPBatch,
    cu_seqlens_from_ids,
    cu_seqlens_from_lengths,
    cu_seqlens_from_positions,
    plan_batch,
)
from hp_cp_core.compression import (
    build_global_compressed_kv_for_cp,
    select_and_pad_smallop,
    stage1_compress_with_halo,
)
from hp_cp_core.config import (
    CPConfig,
    CPContext,
    DeepSeekV4CPConfig,
    DeepSeekV4CPContext,
    LayerSpec,
)
from hp_cp_core.errors import (
    BackendConflictError,
    BackendLoadError,
    BackendNotFoundError,
    HpCpError,
    PlanError,
)
from hp_cp_core.forward import CPForward, DeepSeekV4CPForward
from hp_cp_core.indices import build_cmp_cu_seqlens, build_select_pad_gather_index
from hp_cp_core.padding import CPPadding, pad_for_cp
from hp_cp_core.plan import RankPlan, build_rank_plan
from hp_cp_core.sharing import LayerRoles, SharedState, SharingPlan, plan_sharing
from hp_cp_core.versions import BACKEND_API

hookimpl = pluggy.HookimplMarker("hp_cp")

__version__ = "0.4.0"

__all__ = [
    "BACKEND_API",
    "Backend",
    "BackendConflictError",
    "BackendLoadError",
    "BackendNotFoundError",
    "BatchPlan",
    "CPBatch",
    "CPConfig",
    "CPContext",
    "CPForward",
    "CPHandle",
    "CPPadding",
    "DeepSeekV4CPConfig",
    "DeepSeekV4CPContext",
    "DeepSeekV4CPForward",
    "Group",
    "HpCpError",
    "LayerRoles",
    "LayerSpec",
    "PlanError",
    "RankPlan",
    "SharedState",
    "SharingPlan",
    "build_cmp_cu_seqlens",
    "build_global_compressed_kv_for_cp",
    "build_rank_plan",
    "build_select_pad_gather_index",
    "disable_cp",
    "enable_cp",
    "hookimpl",
    "pad_for_cp",
    "cu_seqlens_from_ids",
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_positions",
    "plan_batch",
    "plan_sharing",
    "select_and_pad_smallop",
    "stage1_compress_with_halo",
]
