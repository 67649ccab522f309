"""hp_cp hook implementations of the torch backend.

No torch import at module level: discovery stays cheap, and a module is only claimed when
torch is already imported (``sys.modules``), since a torch module cannot exist otherwise.
The hooks themselves are the core's :class:`~hp_cp_core.runners.RunnerHooks`.
"""

from __future__ import annotations

from typing import Any

from hp_cp_core.runners import RunnerHooks


def _children(module: Any) -> Any:
    modules = getattr(module, "modules", None)
    return modules() if modules is not None else ()


_HOOKS = RunnerHooks(
    framework="torch",
    runner_for="hp_cp_torch.adapter:runner_for",
    make_backend="hp_cp_torch.adapter:make_backend",
    children=_children,
    install_forward="hp_cp_torch.adapter:install_forward",
)

find_layers = _HOOKS.find_layers
install = _HOOKS.install
hp_cp_backend_api = _HOOKS.hp_cp_backend_api
hp_cp_backend = _HOOKS.hp_cp_backend
hp_cp_layer_spec = _HOOKS.hp_cp_layer_spec
hp_cp_extract_ori_kv = _HOOKS.hp_cp_extract_ori_kv
hp_cp_compress_main = _HOOKS.hp_cp_compress_main
hp_cp_compress_indexer = _HOOKS.hp_cp_compress_indexer
hp_cp_run_attention = _HOOKS.hp_cp_run_attention
