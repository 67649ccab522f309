"""hp_cp hook implementations of the mindformers backend.

No MindSpore import at module level: discovery stays cheap, and a module is only claimed when
MindSpore is already imported (``sys.modules``), since a MindSpore cell cannot exist otherwise.
The hooks themselves are the core's :class:`~hp_cp_core.runners.RunnerHooks`.
"""

from __future__ import annotations

from typing import Any

from hp_cp_core.runners import RunnerHooks


def _children(cell: Any) -> Any:
    cells = getattr(cell, "cells_and_names", None)
    return (c for _, c in cells()) if cells is not None else ()


_HOOKS = RunnerHooks(
    framework="mindspore",
    runner_for="hp_cp_mindformers.adapter:adapter_for",
    make_backend="hp_cp_mindformers.backend:MindSporeBackend",
    children=_children,
    install_forward="hp_cp_mindformers.adapter:install_construct",
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
