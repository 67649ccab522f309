"""The names 0.3.0 replaced, kept for one release: each call warns, naming its replacement.

Every deprecated name of hp_cp_torch warns through :func:`warn_deprecated`, so the message
and the release that removes them are written once.
"""

from __future__ import annotations

import warnings

REMOVED_IN = "0.4.0"
"""The release that removes the names deprecated in 0.3.0."""


def warn_deprecated(old: str, replacement: str) -> None:
    """A :class:`DeprecationWarning` at the caller's caller: ``old`` goes in 0.4.0, use
    ``replacement``."""
    warnings.warn(
        f"{old} is deprecated since hp_cp 0.3.0 and will be removed in {REMOVED_IN}; use "
        f"{replacement} instead.",
        DeprecationWarning,
        stacklevel=3,
    )
