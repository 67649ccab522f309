"""hp_cp hook implementations of the mindformers backend.

No MindSpore import at module level: discovery stays cheap, and a module is only claimed when
MindSpore is already imported (``sys.modules``), since a MindSpore cell cannot exist otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

from hp_cp_core import hookimpl


def _adapter(module: Any) -> Any:
    if sys.modules.get("mindspore") is None:
        return None
    from hp_cp_mindformers.adapter import adapter_for

    return adapter_for(module)


def find_layers(module: Any) -> list[Any]:
    """Every cell (the module itself included) the mindformers plugin has an adapter for."""
    if _adapter(module) is not None:
        return [module]
    cells = getattr(module, "cells_and_names", None)
    if cells is None:
        return []
    return [cell for _, cell in cells() if _adapter(cell) is not None]


def install(layer: Any, cp_forward: Any, group: Any) -> Any:
    """Route ``layer.construct`` through CP; with a group of one the original path stays."""
    if group.size == 1:
        return lambda: None
    from hp_cp_mindformers.adapter import install_construct

    return install_construct(layer, _adapter(layer).make_forward(cp_forward, group))


@hookimpl
def hp_cp_backend(module: Any) -> Any:
    if sys.modules.get("mindspore") is None or not find_layers(module):
        return None
    from hp_cp_mindformers.backend import MindSporeBackend

    return MindSporeBackend(find_layers, install)


@hookimpl
def hp_cp_layer_spec(module: Any) -> Any:
    adapter = _adapter(module)
    return None if adapter is None else adapter.layer_spec()


@hookimpl
def hp_cp_extract_ori_kv(module: Any, key: Any) -> Any:
    adapter = _adapter(module)
    return None if adapter is None else adapter.extract_ori_kv(key)


@hookimpl
def hp_cp_compress_main(module: Any, x: Any, halo_x: Any, call: Any) -> Any:
    adapter = _adapter(module)
    return None if adapter is None else adapter.compress_main(x, halo_x, call)


@hookimpl
def hp_cp_compress_indexer(module: Any, x: Any, halo_x: Any, call: Any) -> Any:
    adapter = _adapter(module)
    return None if adapter is None else adapter.compress_indexer(x, halo_x, call)


@hookimpl
def hp_cp_run_attention(module: Any, query: Any, ori_ext: Any, x: Any, qr: Any, call: Any) -> Any:
    adapter = _adapter(module)
    return None if adapter is None else adapter.run_attention(query, ori_ext, x, qr, call)
