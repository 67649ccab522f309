"""The 0.4 import paths of the modules 0.5 moved into folders, as aliases of their new homes.

Note [Old import paths]
~~~~~~~~~~~~~~~~~~~~~~~
0.5 grouped hp_cp_torch's modules by layer (``distributed/``, ``kernels/``, ``model/``,
``integrations/``). An adapter written against 0.4 still imports ``hp_cp_torch.model_adapter``,
and that import must give the very module that now lives at ``hp_cp_torch.model.spec``: one
``ModelAdapter`` class, one registry, one ``monkeypatch`` target, not a copy::

    import hp_cp_torch.model_adapter
        |   hp_cp_torch.__path__ == [.../hp_cp_torch, .../hp_cp_torch/_compat]
        v
    .../hp_cp_torch/_compat/model_adapter.py        (found in the second folder)
        |   alias(__name__): sys.modules["hp_cp_torch.model_adapter"] = hp_cp_torch.model.spec
        v
    the import statement returns sys.modules' entry: hp_cp_torch.model.spec itself

The package's ``__init__`` puts this folder second on its ``__path__`` (a package may list
several folders, as namespace packages do), so the package's own folder keeps only the
modules of the layout and each old path is one small file here. Nothing is imported
until an old path is; the same module answers to both names. New code imports the new paths.

May import any module it aliases, by name; nothing imports it but the old paths themselves.
"""

from __future__ import annotations

import importlib
import sys
from types import MappingProxyType, ModuleType

MOVED = MappingProxyType(
    {
        "model_adapter": "hp_cp_torch.model.spec",
        "runner": "hp_cp_torch.model.runner",
        "model_registry": "hp_cp_torch.model.registry",
        "validation": "hp_cp_torch.model.validation",
        "indexer_loss": "hp_cp_torch.model.indexer_loss",
        "forward_scope": "hp_cp_torch.distributed.forward_scope",
        "desync": "hp_cp_torch.distributed.desync",
        "exit": "hp_cp_torch.distributed.exit",
        "latent_attention": "hp_cp_torch.kernels.latent_attention",
        "precision": "hp_cp_torch.kernels.precision",
        "hf_layout": "hp_cp_torch.integrations.hf_layout",
    }
)
"""0.4's module name under ``hp_cp_torch`` -> the module's home since 0.5."""


def alias(name: str) -> ModuleType:
    """Make the old module name ``name`` (``hp_cp_torch.<old>``, or this package's
    ``hp_cp_torch._compat.<old>``) the module at its new home, and return that module."""
    module = importlib.import_module(MOVED[name.rpartition(".")[2]])
    sys.modules[name] = module
    return module
