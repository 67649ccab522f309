"""Errors raised by hp_cp. Every message says what was got, what was expected and the fix."""

from __future__ import annotations


class HpCpError(Exception):
    """Base class of every error hp_cp raises on purpose."""


class BackendNotFoundError(HpCpError):
    """No installed backend accepts the module, or ``backend=`` names one that is not installed."""


class BackendConflictError(HpCpError):
    """Two plugins claim the same module (or register the same backend name)."""


class BackendLoadError(HpCpError):
    """A backend plugin failed to import or register; raised from the original exception."""


class PlanError(HpCpError):
    """The inputs cannot be planned (shapes, cu_seqlens, layout constraints)."""


INSTALL_HINTS = {
    "torch": "pip install hp-cp-torch",
    "mindformers": "pip install hp-cp-mindformers",
}
