"""Backend API versions: what a plugin declares (``hp_cp_backend_api``) and how the core
treats it.

* ``"0.2"`` (:data:`BACKEND_API`): current. Groups thread order tokens
  (``begin_order`` / ``exchange_rows(items, token)`` / ``all_gather_rows(tensor, token)`` /
  ``end_order``; Note [Backward order] in :mod:`hp_cp_core.collectives`).
* ``"0.1"`` (or no declaration): the protocol before tokens, ``exchange_rows(items) -> list``
  and ``all_gather_rows(tensor) -> tensor``. Its group is wrapped in :class:`LegacyGroup`,
  which passes placeholder (``None``) tokens through, with a ``DeprecationWarning``. That is
  correct where the framework's backward is the forward program reversed (JAX's transpose,
  a numpy forward-only backend), because the order of the backward exchanges is then fixed
  already. It is not correct for eager autograd (torch, MindSpore PyNative): there a rank
  that owns no compressed slot may run the backward exchanges in another order than its
  peers and hang, so a 0.1 group for a module of such a framework is refused.
* anything else: unusable with this core.

Every refusal is one :class:`~hp_cp_core.errors.HpCpError`, raised in ``enable_cp`` before
the group runs a collective, naming what is missing and :data:`MIGRATION`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from hp_cp_core.errors import HpCpError

BACKEND_API = "0.2"
"""The backend API this core implements (``hp_cp_backend_api`` of a current plugin)."""
LEGACY_API = "0.1"
"""The older backend API this core still adapts."""
MIGRATION = (
    "docs/writing-a-backend.md, section 'Migrating a backend from 0.1 to 0.2', in the hp_cp "
    "repository"
)
CURRENT, ADAPTED, UNUSABLE = "current", "adapted", "unusable"

GROUP_METHODS_0_1 = (
    "exchange_rows",
    "all_gather_rows",
    "all_gather_dim",
    "all_gather_meta",
    "stats",
)
GROUP_METHODS_0_2 = ("begin_order", "end_order", *GROUP_METHODS_0_1)
EAGER_AUTOGRAD = ("torch", "mindspore")
"""Frameworks (top-level module of the layer's type) whose autograd does not replay the
forward program reversed: placeholder tokens are not correct for them."""


def declared_api(plugin: Any) -> str:
    """The backend API ``plugin`` declares (its own ``hp_cp_backend_api``); ``"0.1"`` when it
    implements no such hook or answers ``None``."""
    fn = getattr(plugin, "hp_cp_backend_api", None)
    if fn is None or not callable(fn):
        return LEGACY_API
    got = fn()
    return LEGACY_API if got is None else str(got)


def api_status(version: str) -> str:
    """``current``, ``adapted`` or ``unusable`` for a declared backend API version."""
    if version == BACKEND_API:
        return CURRENT
    if version == LEGACY_API:
        return ADAPTED
    return UNUSABLE


def _missing(group: Any, names: Sequence[str]) -> list[str]:
    return [n for n in names if not callable(getattr(group, n, None))]


def check_api_usable(version: str, backend: str) -> None:
    """An ``HpCpError`` when this core can neither run nor adapt backend API ``version``."""
    if api_status(version) == UNUSABLE:
        raise HpCpError(
            f"backend {backend!r} implements hp_cp backend API {version!r}; this hp-cp-core "
            f"implements {BACKEND_API} and adapts {LEGACY_API}. Install a release of the "
            f"backend for backend API {BACKEND_API}, or an hp-cp-core that implements "
            f"{version} (see CHANGELOG.md)."
        )


def check_group_api(group: Any, version: str, backend: str, module: Any) -> Any:
    """The group the core runs: ``group`` itself for a current plugin, a :class:`LegacyGroup`
    for a 0.1 one (with a ``DeprecationWarning``); an ``HpCpError`` for an unusable one."""
    check_api_usable(version, backend)
    if api_status(version) == CURRENT:
        missing = _missing(group, GROUP_METHODS_0_2)
        if missing:
            raise HpCpError(
                f"backend {backend!r} declares hp_cp backend API {BACKEND_API} but its group "
                f"`{type(group).__name__}` has no {', '.join(missing)}; implement them (order "
                f"tokens) as described in {MIGRATION}."
            )
        return group
    missing = _missing(group, GROUP_METHODS_0_1)
    framework = (type(module).__module__ or "").split(".")[0]
    why = ""
    if missing:
        why = f"has no {', '.join(missing)}"
    elif framework in EAGER_AUTOGRAD:
        why = (
            f"cannot be adapted for a {framework} module: {framework}'s autograd does not run "
            "the backward exchanges in the reverse forward order by itself, so placeholder "
            "order tokens could hang backward"
        )
    if why:
        tokens = ", ".join(_missing(group, ("begin_order", "end_order")))
        raise HpCpError(
            f"backend {backend!r} implements hp_cp backend API {LEGACY_API} (no "
            f"hp_cp_backend_api hook) and its group `{type(group).__name__}` {why}. Missing "
            f"for {BACKEND_API}: {tokens or 'none'}; the token arguments of exchange_rows and "
            f"all_gather_rows. Migrate it as described in {MIGRATION}."
        )
    warnings.warn(
        f"hp_cp backend {backend!r} implements backend API {LEGACY_API} (its group "
        f"`{type(group).__name__}` takes no order tokens); hp-cp-core adapts it with "
        "placeholder tokens, which is correct only where the framework's backward is the "
        f"forward program reversed (JAX, forward-only numpy). Backend API {LEGACY_API} "
        f"support will be removed in hp-cp-core 1.0; migrate as described in {MIGRATION}.",
        DeprecationWarning,
        stacklevel=3,
    )
    return LegacyGroup(group)


class LegacyGroup:
    """A 0.1 ``Group`` (no order tokens) seen through the 0.2 protocol: placeholder ``None``
    tokens passed through. The 0.1 ``exchange_rows`` was a halo exchange only, so the
    compressed slots travel by ``all_gather_rows`` (``point_to_point`` is ``False``)."""

    point_to_point = False

    def __init__(self, group: Any) -> None:
        self.legacy = group
        self.rank = group.rank
        self.size = group.size

    def begin_order(self, anchor: Any) -> Any:
        return None

    def exchange_rows(self, items: Sequence[tuple[Any, Any]], token: Any) -> tuple[list, Any]:
        return list(self.legacy.exchange_rows(items)), token

    def all_gather_rows(self, tensor: Any, token: Any) -> tuple[Any, Any]:
        return self.legacy.all_gather_rows(tensor), token

    def end_order(self, output: Any, token: Any) -> Any:
        return output

    def all_gather_dim(self, tensor: Any, dim: int) -> Any:
        return self.legacy.all_gather_dim(tensor, dim)

    def all_gather_meta(self, values: Any) -> Any:
        return self.legacy.all_gather_meta(values)

    def stats(self) -> dict[str, Any]:
        return self.legacy.stats()
