"""hp_cp_torch: the PyTorch backend of hp_cp.

Public entry points: :class:`DeepSeekV4Attention` / :class:`DeepSeekV4AttentionConfig` (the
single-device reference layer), :class:`TorchDeepSeekV4CSAAdapter` and
:func:`patch_torch_deepseek_v4_csa_forward` (the design note's adapter API),
:class:`ModelAdapter` (the base of a model adapter registered under the entry-point group
``hp_cp.torch_models``, or in one process :func:`register_model_adapter`) and
:func:`register_kernel` (an attention kernel by name; or the group ``hp_cp.torch_kernels``).
Use ``hp_cp_core.enable_cp(module, mesh)`` to run any of them under CP.

The package by layer, lowest first (each folder's docstring says what it may import):
:mod:`~hp_cp_torch.distributed` (per-forward records, the desync report, clean exit) and
:mod:`~hp_cp_torch.kernels`; the collectives (:mod:`~hp_cp_torch.backend`) and the kernel
dispatch (:mod:`~hp_cp_torch.attention`); :mod:`~hp_cp_torch.model` (the spec a model file
fills and the runner); what installs it (:mod:`~hp_cp_torch.adapter`, the plugin, the
reference layer); :mod:`~hp_cp_torch.integrations` (model files), :mod:`~hp_cp_torch.cli` and
:mod:`~hp_cp_torch.bench`.
"""

from __future__ import annotations

import os
from typing import Any

# 0.4's module paths (hp_cp_torch.model_adapter, .runner, ...) resolve through the second
# folder of the package's path to their homes since 0.5: Note [Old import paths] in _compat.
__path__.append(os.path.join(os.path.dirname(__file__), "_compat"))

_LAZY = {
    "DeepSeekV4Attention": "hp_cp_torch.reference",
    "DeepSeekV4AttentionConfig": "hp_cp_torch.reference",
    "TorchDeepSeekV4CSAAdapter": "hp_cp_torch.adapter",
    "patch_torch_deepseek_v4_csa_forward": "hp_cp_torch.adapter",
    "ModelAdapter": "hp_cp_torch.model.spec",
    "register_kernel": "hp_cp_torch.kernels.registry",
    "register_model_adapter": "hp_cp_torch.model.registry",
    "unregister_model_adapter": "hp_cp_torch.model.registry",
}


def __getattr__(name: str) -> Any:
    # Lazy so that discovering the plugin (hp_cp_torch._plugin) never imports torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hp_cp_torch' has no attribute {name!r}")


__version__ = "0.4.0"

__all__ = list(_LAZY)
