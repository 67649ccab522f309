"""Which model adapter runs a module: entry points of group ``hp_cp.torch_models``.

A package that brings a model to hp_cp declares, in its ``pyproject.toml``::

    [project.entry-points."hp_cp.torch_models"]
    "my_models.attention:FusedAttention" = "my_models_cp.adapter:FusedAttentionAdapter"

The entry point's *name* is the qualified name of the modeling class it claims
(``"package.module:Class"`` or ``"package.module.Class"``), its *value* the adapter class
(a :class:`hp_cp_torch.model.spec.ModelAdapter`). A name without a dot or colon instead
names the adapter itself, whose ``claims`` attribute lists the classes (that adapter's module
is imported when the registry is read, so it must not import its model package). hp_cp_torch
registers its own integrations the same way (its ``pyproject.toml``).

Matching imports nothing: a module's classes are its ``type(module).__mro__``, each named
``f"{cls.__module__}.{cls.__qualname__}"``; the first (most derived) one some entry point
claims picks the adapter, whose module is imported then. A module can only be an instance of
a class whose package is already imported, so discovery never imports a model package.

Errors never hide other adapters: an entry point that fails to load is recorded in
:attr:`ModelRegistry.problems` and raised as :class:`~hp_cp_core.HpCpError` only for a module
it claims; two adapters claiming one class raise an ``HpCpError`` naming both when a module
of that class is looked up.

The registry is read from the installed distributions on first use and kept per ``sys.path``
(:func:`model_registry`), a cache ``model_registry.cache_clear()`` empties.

In one process (a test, a notebook, an adapter not yet published),
:func:`register_model_adapter` maps a class to an adapter without an entry point; it shadows
an entry point's claim on the same class, as ``register_kernel`` shadows a kernel.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import sys
from dataclasses import dataclass, field
from typing import Any

from hp_cp_core import HpCpError

__all__ = [
    "ENTRY_POINT_GROUP",
    "Claim",
    "ModelRegistry",
    "adapter_class_for",
    "model_registry",
    "register_model_adapter",
    "unregister_model_adapter",
]

ENTRY_POINT_GROUP = "hp_cp.torch_models"


def class_name(cls: type) -> str:
    """``"package.module.Class"`` (the form claims are compared in)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _normalise(name: str) -> str:
    return name.strip().replace(":", ".")


def _is_class_name(name: str) -> bool:
    return "." in name or ":" in name


@dataclass(frozen=True)
class Claim:
    """One adapter's claim on one modeling class."""

    class_name: str
    """The claimed class, ``"package.module.Class"``."""
    entry_point: Any
    """The ``importlib.metadata.EntryPoint`` naming the adapter."""

    def describe(self) -> str:
        dist = getattr(self.entry_point, "dist", None)
        where = f" (distribution {dist.metadata['Name']})" if dist is not None else ""
        return f"{self.entry_point.value}{where}"

    def load(self) -> type:
        """The adapter class (its module imported now).

        Raises:
            HpCpError: the entry point fails to load.
        """
        try:
            return self.entry_point.load()
        except Exception as exc:  # noqa: BLE001 - named in the error
            raise HpCpError(
                f"the model adapter {self.describe()} registered for {self.class_name} (entry "
                f"point {self.entry_point.name!r}, group {ENTRY_POINT_GROUP}) failed to load: "
                f"{type(exc).__name__}: {exc}. Fix or uninstall that package."
            ) from exc


@dataclass
class ModelRegistry:
    """The modeling classes adapters claim, read from entry points (nothing imported for the
    class-named ones)."""

    claims: dict[str, list[Claim]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """Entry points that could not be read (an adapter-named one that failed to load, or
    whose ``claims`` is not a list of class names); the others still work."""

    @classmethod
    def from_entry_points(cls, entry_points: Any) -> ModelRegistry:
        registry = cls()
        for ep in entry_points:
            if _is_class_name(ep.name):
                registry._add(Claim(_normalise(ep.name), ep))
                continue
            try:
                adapter = ep.load()
                names = list(getattr(adapter, "claims", ()))
                if not all(isinstance(n, str) and _is_class_name(n) for n in names):
                    raise TypeError(f"claims must be qualified class names, got {names!r}")
            except Exception as exc:  # noqa: BLE001 - one broken adapter hides no other
                registry.problems.append(
                    f"model adapter entry point {ep.name!r} = {ep.value!r} (group "
                    f"{ENTRY_POINT_GROUP}): {type(exc).__name__}: {exc}"
                )
                continue
            for name in names:
                registry._add(Claim(_normalise(name), ep))
        return registry

    def _add(self, claim: Claim) -> None:
        same = self.claims.setdefault(claim.class_name, [])
        if all(c.entry_point.value != claim.entry_point.value for c in same):
            same.append(claim)

    def claim_on(self, name: str) -> Claim | None:
        """The claim on the class named ``name`` (``"package.module.Class"``), else ``None``.

        Raises:
            HpCpError: two adapters claim that class.
        """
        found = self.claims.get(name)
        if found and len(found) > 1:
            listing = " and ".join(c.describe() for c in found)
            raise HpCpError(
                f"two model adapters claim {name}: {listing} (entry points of group "
                f"{ENTRY_POINT_GROUP}). Uninstall one of the two distributions "
                "(pip uninstall <name>): one class has one adapter."
            )
        return found[0] if found else None


@functools.lru_cache(maxsize=4)
def _registry(source: Any, path: tuple[str, ...]) -> ModelRegistry:
    del path  # part of the cache key: a changed sys.path re-reads the entry points
    return ModelRegistry.from_entry_points(source(group=ENTRY_POINT_GROUP))


def model_registry() -> ModelRegistry:
    """The registry of the installed ``hp_cp.torch_models`` entry points.

    Read once per ``sys.path`` (a lookup per module of a model must not rescan the installed
    distributions); a package installed into a running process is seen after
    ``model_registry.cache_clear()``.
    """
    return _registry(md.entry_points, tuple(sys.path))


model_registry.cache_clear = _registry.cache_clear  # type: ignore[attr-defined]


_IN_PROCESS: dict[str, type] = {}  # register_model_adapter's, by class name


def _model_class_name(model_class: Any, caller: str) -> str:
    if isinstance(model_class, type):
        return class_name(model_class)
    if isinstance(model_class, str) and _is_class_name(model_class):
        return _normalise(model_class)
    raise HpCpError(
        f"{caller}: the model class must be a class or its qualified name "
        f"('package.module.Class'), got {model_class!r}."
    )


def register_model_adapter(model_class: type | str, adapter: type) -> None:
    """Run modules of ``model_class`` (and its subclasses) with ``adapter`` in this process.

    What an entry point of group ``hp_cp.torch_models`` does for an installed package, for
    an adapter not published yet (a test, a notebook). It shadows an entry point's claim on
    the same class; it applies to layers ``enable_cp`` installs from now on.

    Args:
        model_class: the modeling class, or its qualified name ``"package.module.Class"``
            (``"package.module:Class"`` too).
        adapter: a subclass of :class:`hp_cp_torch.model.spec.ModelAdapter`.

    Raises:
        HpCpError: ``model_class`` is neither a class nor a qualified name, or ``adapter``
            is not a ``ModelAdapter`` subclass.
    """
    from hp_cp_torch.model.spec import ModelAdapter

    name = _model_class_name(model_class, "register_model_adapter")
    if not (isinstance(adapter, type) and issubclass(adapter, ModelAdapter)):
        raise HpCpError(
            f"register_model_adapter({name!r}, ...): the adapter must be a subclass of "
            f"hp_cp_torch.ModelAdapter, got {adapter!r}."
        )
    _IN_PROCESS[name] = adapter


def unregister_model_adapter(model_class: type | str) -> None:
    """Remove what :func:`register_model_adapter` registered for ``model_class`` (nothing if
    there is none); the entry points' claim, if any, applies again."""
    _IN_PROCESS.pop(_model_class_name(model_class, "unregister_model_adapter"), None)


def adapter_class_for(module: Any, registry: ModelRegistry | None = None) -> type | None:
    """The adapter class registered for ``module``'s class (or its most derived base class
    that has one: in this process, else by entry point), else ``None``.

    Raises:
        HpCpError: its entry point fails to load, or two adapters claim its class.
    """
    registry = registry or model_registry()
    for cls in type(module).__mro__:
        name = class_name(cls)
        if name in _IN_PROCESS:
            return _IN_PROCESS[name]
        claim = registry.claim_on(name)
        if claim is not None:
            return claim.load()
    return None


def registered_adapter(module: Any, *adapters: type) -> Any:
    """``cls(module)`` when the entry points register one of ``adapters`` (exactly that
    class) for ``module``'s class, else ``None``: a model file asks "is this my layer?"
    without writing its modeling class paths a second time (they live in the entry points).

    Raises:
        HpCpError: as :func:`adapter_class_for`, or what the adapter raises (a refusal).
    """
    cls = adapter_class_for(module)
    return cls(module) if cls is not None and cls in adapters else None
