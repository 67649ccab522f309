"""The hp_cp hooks of the JAX example (entry point ``hp_cp: jax``).

Loaded by hp_cp discovery in every process, so it imports no JAX: a module is claimed only
when JAX is already imported (a ``SparseAttention`` cannot exist otherwise), and the JAX
code is imported inside the hooks.
"""

from __future__ import annotations

import sys
from typing import Any

from hp_cp_core import LayerSpec, hookimpl, stage1_compress_with_halo


def _ours(module: Any) -> bool:
    if sys.modules.get("jax") is None:
        return False
    from hp_cp_jax.layer import SparseAttention

    return isinstance(module, SparseAttention)


@hookimpl
def hp_cp_backend_api() -> str:
    return "0.2"  # the backend API of hp-cp-core 0.2 (CHANGELOG.md, "Backend API")


@hookimpl
def hp_cp_backend(module: Any) -> Any:
    if not _ours(module):
        return None
    from hp_cp_jax.backend import JaxBackend

    return JaxBackend()


@hookimpl
def hp_cp_layer_spec(module: Any) -> Any:
    if not _ours(module):
        return None
    return LayerSpec(compress_ratio=module.r, window_size=module.window, has_indexer=module.r == 4)


@hookimpl
def hp_cp_extract_ori_kv(module: Any, key: Any) -> Any:
    return key if _ours(module) else None


def _compress(module: Any, x: Any, halo_x: Any, call: Any, weight: str) -> Any:
    params = call.extra["params"]  # traced by jax.vjp: passed to cp_forward, see layer.apply
    return stage1_compress_with_halo(
        lambda rows, offset: module.compress(params, rows, offset, weight), x, halo_x, call
    )


@hookimpl
def hp_cp_compress_main(module: Any, x: Any, halo_x: Any, call: Any) -> Any:
    return _compress(module, x, halo_x, call, "wc") if _ours(module) else None


@hookimpl
def hp_cp_compress_indexer(module: Any, x: Any, halo_x: Any, call: Any) -> Any:
    return _compress(module, x, halo_x, call, "wci") if _ours(module) else None


@hookimpl
def hp_cp_run_attention(module: Any, query: Any, ori_ext: Any, x: Any, qr: Any, call: Any) -> Any:
    return module.attend_cp(query, ori_ext, qr, call) if _ours(module) else None
