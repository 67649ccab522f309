"""The names 0.4.0 removed: a module's ``__getattr__ = removed_names(__name__, old=new)``
makes importing one an ``ImportError`` that names its replacement (CHANGELOG, 0.4.0); and
the names 0.5.0 deprecates: :func:`deprecated` warns once per call site, naming the
replacement and the release that removes them (CHANGELOG, 0.5.0)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NoReturn

ENABLE = "hp_cp_core.enable_cp(model, mesh, config)"
DISABLE = "hp_cp_core.disable_cp(handle)"
NEMO_BATCH = "hp_cp_torch.integrations.nemo_automodel.cp_nemo_batch"
ADAPTER_FOR = "hp_cp_torch.adapter.adapter_for(module) (the registry of hp_cp.torch_models)"
REGISTRY = (
    "hp_cp_torch.adapter.adapter_for(module) (the hp_cp.torch_models entry points; "
    "hp_cp_torch.model.registry.register_model_adapter(cls, adapter) for a class of your own)"
)
REMOVED_IN = "0.6.0"
"""The release that removes the names 0.5.0 deprecates."""


def deprecated(name: str, replacement: str, *, stacklevel: int = 3) -> None:
    """Warn that ``name`` (``"module.name"``) is deprecated since 0.5.0 and removed in
    :data:`REMOVED_IN`, naming ``replacement``; called by the deprecated name itself, so
    ``stacklevel=3`` points at its caller."""
    warnings.warn(
        f"{name} is deprecated since hp_cp 0.5.0 and will be removed in {REMOVED_IN}; use "
        f"{replacement} instead.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def removed_names(module: str, **gone: str) -> Callable[[str], NoReturn]:
    """The module-level ``__getattr__`` of ``module``: a name of ``gone`` (removed name =
    what replaces it) raises an ``ImportError`` naming its replacement, any other missing
    name the usual ``AttributeError``."""

    def __getattr__(name: str) -> NoReturn:
        if name in gone:
            raise ImportError(
                f"{module}.{name} was removed in hp_cp 0.4.0 (deprecated since 0.3.0); use "
                f"{gone[name]} instead.",
                name=name,
            )
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
