"""hp_cp hook implementations of the torch backend.

No torch import at module level: discovery stays cheap, and a module is only claimed when
torch is already imported (``sys.modules``), since a torch module cannot exist otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

from hp_cp_core import hookimpl


def _adapter(module: Any) -> Any:
    if "torch" not in sys.modules:
        return None
    from hp_cp_torch.adapter import adapter_for

    return adapter_for(module)


def find_layers(module: Any) -> list[Any]:
    """Every sub-module (the module itself included) the torch plugin has an adapter for."""
    if _adapter(module) is not None:
        return [module]
    modules = getattr(module, "modules", None)
    if modules is None:
        return []
    return [m for m in modules() if _adapter(m) is not None]


def install(layer: Any, cp_forward: Any, group: Any) -> Any:
    """Route ``layer.forward`` through CP; with a group of one the original path stays."""
    if group.size == 1:
        return lambda: None
    from hp_cp_torch.adapter import install_forward

    return install_forward(layer, _adapter(layer).make_forward(cp_forward, group))


@hookimpl
def hp_cp_backend(module: Any) -> Any:
    if "torch" not in sys.modules or not find_layers(module):
        return None
    from hp_cp_torch.backend import TorchBackend

    return TorchBackend(find_layers, install)


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
