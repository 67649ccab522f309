"""hp_cp_mindformers: the MindSpore / MindFormers backend of hp_cp.

Importing this package does not import MindSpore (plugin discovery loads
:mod:`hp_cp_mindformers._plugin`, which imports nothing heavy); the public names below are
loaded on first use:

* :func:`patch_mindformers_deepseek_v4_csa_forward` and the compatible
  :func:`patch_deepseek_v4_compressed_sparse_attention_forward`: run a mindformers
  ``CompressedSparseAttention`` cell under CP (``hp_cp_core.enable_cp(cell, mesh)`` also works);
* :class:`MindFormersDeepSeekV4CSAAdapter`: how the hooks reach into the cell;
* :class:`MindSporeBackend`, :class:`MindSporeGroup`: ops and autograd-aware collectives.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.4.0"

_LAZY = {
    "MindFormersDeepSeekV4CSAAdapter": "hp_cp_mindformers.adapter",
    "patch_mindformers_deepseek_v4_csa_forward": "hp_cp_mindformers.adapter",
    "patch_deepseek_v4_compressed_sparse_attention_forward": "hp_cp_mindformers.adapter",
    "MindSporeBackend": "hp_cp_mindformers.backend",
    "MindSporeGroup": "hp_cp_mindformers.backend",
    "Capabilities": "hp_cp_mindformers.backend",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hp_cp_mindformers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
