"""Entry-point discovery, backend choice and a typed facade over ``pm.hook``.

Discovery loops over ``importlib.metadata.entry_points(group="hp_cp")`` itself and wraps each
load and registration, so one broken plugin never hides the others; its error is shown when
it was needed or named. Environment switches:

* ``HP_CP_PLUGINS=torch,mindformers``: allow-list of entry points to load (empty: none).
* ``HP_CP_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point except those in ``HP_CP_PLUGINS``.
* ``HP_CP_TRACE_PLUGINS=1``: print every hook call (pluggy tracing).
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata as md
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from hp_cp_core import hookspecs
from hp_cp_core.errors import (
    INSTALL_HINTS,
    BackendConflictError,
    BackendLoadError,
    BackendNotFoundError,
    HpCpError,
)
from hp_cp_core.versions import BACKEND_API, UNUSABLE, api_status, declared_api

ENTRY_POINT_GROUP = "hp_cp"
PROJECT = "hp_cp"
SWITCHES = ("HP_CP_PLUGINS", "HP_CP_DISABLE_PLUGIN_AUTOLOAD", "HP_CP_TRACE_PLUGINS")
GUIDE = "docs/writing-a-backend.md in the hp_cp repository"
MODEL_GUIDE = "docs/writing-a-model-adapter.md in the hp_cp repository"
FRAMEWORK_BACKENDS = {"torch": "torch", "mindspore": "mindformers", "mindformers": "mindformers"}
"""The backend of this project for modules of each framework (top-level module name)."""


def active_switches() -> dict[str, str]:
    """The discovery switches set in the environment, and their values."""
    return {k: os.environ[k] for k in SWITCHES if k in os.environ}


@dataclass
class BackendStatus:
    """One discovered plugin: where it came from and whether it loaded."""

    name: str
    dist: str | None
    version: str | None
    ok: bool
    error: str | None = None
    exc: BaseException | None = None
    backend_api: str | None = None
    """The backend API the plugin declares (``hp_cp_backend_api``; ``"0.1"`` without it)."""

    @property
    def api_status(self) -> str | None:
        """``current``, ``adapted`` or ``unusable`` (:mod:`hp_cp_core.versions`); ``None``
        for a plugin that did not load."""
        if not self.ok:
            return None
        return api_status(self.backend_api) if self.backend_api else UNUSABLE

    def describe(self) -> str:
        where = f"{self.dist} {self.version}" if self.dist else "in-process"
        return f"{self.name} ({where})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dist": self.dist,
            "version": self.version,
            "status": "ok" if self.ok else "error",
            "error": self.error,
            "backend_api": self.backend_api,
            "api_status": self.api_status,
        }


def _dist_of(ep: Any) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _env_allow_list() -> set[str] | None:
    raw = os.environ.get("HP_CP_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


class PluginHost:
    """A pluggy ``PluginManager`` for hp_cp plus the status of every discovered plugin."""

    def __init__(self, *, autoload: bool | None = None, entry_points: Iterable[Any] | None = None):
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.statuses: dict[str, BackendStatus] = {}
        self.conflicts: dict[str, list[BackendStatus]] = {}
        if os.environ.get("HP_CP_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(lambda s: sys.stderr.write(s))
            self.pm.enable_tracing()
        allow = _env_allow_list()
        if autoload is None:
            autoload = not os.environ.get("HP_CP_DISABLE_PLUGIN_AUTOLOAD")
        if autoload or allow or entry_points is not None:
            self.discover(entry_points, allow=allow)

    # -- discovery ---------------------------------------------------------------------------
    def discover(self, entry_points: Iterable[Any] | None = None, *, allow: set[str] | None = None):
        """Load and register every entry point of group ``hp_cp`` (or the given ones)."""
        eps = entry_points if entry_points is not None else md.entry_points(group=ENTRY_POINT_GROUP)
        for ep in eps:
            if allow is not None and ep.name not in allow:
                continue
            dist, version = _dist_of(ep)
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - isolate every plugin
                self._record(BackendStatus(ep.name, dist, version, False, _fmt(exc), exc))
                continue
            self.add(plugin, ep.name, dist=dist, version=version)
        self.pm.check_pending()

    def add(self, plugin: Any, name: str, *, dist: str | None = None, version: str | None = None):
        """Register ``plugin`` as backend ``name`` (tests and in-process backends use this)."""
        status = BackendStatus(name, dist, version, True)
        if self.pm.has_plugin(name) or (name in self.statuses and self.statuses[name].ok):
            status.ok = False
            status.error = "another plugin already registered this backend name"
            self.conflicts.setdefault(name, [self.statuses[name]]).append(status)
            return
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001
            self._record(BackendStatus(name, dist, version, False, _fmt(exc), exc))
            return
        unknown = self._unknown_hooks(plugin)
        if unknown:
            self.pm.unregister(plugin)
            exc = HpCpError("; ".join(unknown))
            self._record(BackendStatus(name, dist, version, False, str(exc), exc))
            return
        try:
            status.backend_api = declared_api(plugin)
        except Exception as exc:  # noqa: BLE001 - a broken hook makes the plugin unusable
            status.backend_api = None
            status.error = f"hp_cp_backend_api failed: {_fmt(exc)}"
        self._record(status)

    def backend_api(self, name: str) -> str:
        """The backend API plugin ``name`` declares (``"0.1"`` without ``hp_cp_backend_api``);
        an ``HpCpError`` when its hook failed."""
        status = self.statuses.get(name)
        if status is None or status.backend_api is None:
            why = status.error if status is not None else "it is not registered"
            raise HpCpError(
                f"cannot tell which hp_cp backend API plugin {name!r} implements: {why}. Its "
                f"hp_cp_backend_api hook must return a version such as {BACKEND_API!r}."
            )
        return status.backend_api

    def remove(self, name: str) -> None:
        """Unregister backend ``name`` (tests)."""
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        self.statuses.pop(name, None)
        self.conflicts.pop(name, None)

    def _record(self, status: BackendStatus) -> None:
        self.statuses[status.name] = status

    def _unknown_hooks(self, plugin: Any) -> list[str]:
        known = [n for n in dir(hookspecs) if n.startswith("hp_cp_")]
        problems = []
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.spec is None and caller.name.startswith("hp_cp_"):
                close = difflib.get_close_matches(caller.name, known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append(
                    f"unknown hook {caller.name}{hint}; hp_cp hooks are {', '.join(known)}"
                )
        return problems

    # -- choosing a backend --------------------------------------------------------------------
    def installed(self) -> list[BackendStatus]:
        return [s for s in self.statuses.values() if s.ok]

    def broken(self) -> list[BackendStatus]:
        return [s for s in self.statuses.values() if not s.ok]

    def report(self) -> list[dict[str, Any]]:
        rows = [s.as_dict() for s in self.statuses.values()]
        for extra in self.conflicts.values():
            rows.extend(s.as_dict() for s in extra[1:])
        return rows

    def choose_backend(self, module: Any, backend: str | None = None) -> tuple[str, Any]:
        """The one backend that owns ``module``: the only one answering ``hp_cp_backend``, or
        the one named by ``backend``; none or several is an error (docs/design.md, "Plugins")."""
        if backend is not None:
            return backend, self._named_backend(module, backend)
        answers = []
        for impl in self.pm.hook.hp_cp_backend.get_hookimpls():
            result = impl.function(module=module)
            if result is not None:
                answers.append((impl.plugin_name, result))
        for name, _ in answers:
            if name in self.conflicts:
                raise self._conflict_by_name(name)
        if not answers:
            raise BackendNotFoundError(self._not_found_message(module))
        if len(answers) > 1:
            names = [n for n, _ in answers]
            who = ", ".join(self._describe(n) for n in names)
            raise BackendConflictError(
                f"{len(answers)} hp_cp backends claim a `{type(module).__name__}`: {who}. "
                f"Expected exactly one. Choose with enable_cp(..., backend={names[0]!r}) "
                "or uninstall one of them."
            )
        return answers[0]

    def _named_backend(self, module: Any, name: str) -> Any:
        if name in self.conflicts:
            raise self._conflict_by_name(name)
        status = self.statuses.get(name)
        if status is None:
            valid = sorted(s.name for s in self.installed())
            hint = INSTALL_HINTS.get(name)
            fix = f" Install it with `{hint}`." if hint else ""
            raise BackendNotFoundError(
                f"backend={name!r} is not an installed hp_cp backend; valid names: "
                f"{valid or 'none installed'}.{fix}"
            )
        if not status.ok:
            where = f"{status.dist} {status.version or ''}".strip() if status.dist else "in-process"
            raise BackendLoadError(
                f'Error loading hp_cp backend "{name}" from {where}: {status.error}'
            ) from status.exc
        plugin = self.pm.get_plugin(name)
        impl = getattr(plugin, "hp_cp_backend", None)
        result = impl(module=module) if impl is not None else None
        if result is None:
            raise BackendNotFoundError(
                f"backend {name!r} does not accept a `{type(module).__name__}`; expected a "
                f"module it recognises. {self._others_hint(module)}"
            )
        return result

    def _conflict_by_name(self, name: str) -> BackendConflictError:
        claimants = self.conflicts[name]
        who = " and ".join(s.describe() for s in claimants)
        return BackendConflictError(
            f"two plugins register the hp_cp backend name {name!r}: {who}. Expected one "
            f"distribution per backend name; uninstall one of them (pip uninstall ...)."
        )

    def _describe(self, name: str) -> str:
        status = self.statuses.get(name)
        return status.describe() if status else name

    def _others_hint(self, module: Any) -> str:
        return self._not_found_message(module)

    def _not_found_message(self, module: Any) -> str:
        installed = ", ".join(s.describe() for s in self.installed()) or "none"
        broken = "; ".join(f"{s.name} ({s.error})" for s in self.broken()) or "none"
        framework = _framework_of(module)
        known = FRAMEWORK_BACKENDS.get(framework)
        if known is not None and known not in self.statuses:
            fix = f" Install the {framework} backend with `{INSTALL_HINTS[known]}`."
        elif known is not None:
            fix = (
                f" The {known!r} backend runs the attention layers a model adapter claims, and "
                f"none claims this module or its sub-modules: add an adapter for your layer "
                f"(see {MODEL_GUIDE}) or hooks for it (see {GUIDE})."
            )
        else:
            fix = (
                f" No installed backend runs `{framework}` modules; a backend for another "
                f"framework or layer is a plugin: see {GUIDE}."
            )
        off = active_switches()
        if off:
            fix += " Discovery switches: " + ", ".join(f"{k}={v}" for k, v in off.items()) + "."
        return (
            f"no hp_cp backend accepts a `{type(module).__module__}.{type(module).__name__}` "
            f"(framework: {framework or 'unknown'}); installed: {installed}; broken: {broken}."
            f"{fix}"
        )

    # -- hooks ---------------------------------------------------------------------------------
    @property
    def hooks(self) -> Hooks:
        return Hooks(self.pm)


def _framework_of(module: Any) -> str:
    """The top-level package of the first class in ``module``'s MRO that belongs to a
    framework this project has a backend for (a user's ``nn.Module`` subclass is torch's),
    else of the module's own class."""
    for cls in type(module).__mro__:
        top = (cls.__module__ or "").split(".")[0]
        if top in FRAMEWORK_BACKENDS:
            return top
    return (type(module).__module__ or "").split(".")[0]


class Hooks:
    """Typed facade over ``pm.hook``: a missing answer becomes an error naming hook and module.

    Note [A direct runtime path]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A backend built on :class:`~hp_cp_core.runners.RunnerHooks` answers every stage hook by
    finding the module's runner and calling it. Its runner hands the core's forward
    (:class:`~hp_cp_core.forward.CPForward`) itself as ``stages`` for each forward, so a stage
    call goes straight to it::

        stage call --(no stage-only plugin implements the stage)--> stages.run_attention(...)
                   --(one does: an override, tryfirst)-->  pm.hook.hp_cp_run_attention
                        -> the override, or (it answers None) the backend's hook, as before

    Every stage hook of a backend (a plugin implementing ``hp_cp_backend``) returns ``None``
    for a module it does not own (the contract of :mod:`hp_cp_core.hookspecs`), so only a
    plugin without ``hp_cp_backend`` can answer a stage before the owner: when one
    implements the stage, the hook runs, so a plugin overrides one stage
    (docs/overriding-a-stage.md). A backend on API 0.2 that hands no stage object keeps the
    hook calls.
    ``HP_CP_TRACE_PLUGINS`` traces hook calls only.
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._hook = pm.hook

    def _first(self, name: str, module: Any, **kwargs: Any) -> Any:
        result = getattr(self._hook, name)(module=module, **kwargs)
        if result is None:
            raise HpCpError(
                f"no hp_cp plugin implements {name} for a `{type(module).__name__}`; expected "
                "the module's backend to answer. Is the backend that enabled it still registered?"
            )
        return result

    def overridden(self, name: str) -> bool:
        """Whether a plugin that is no backend (no ``hp_cp_backend``) implements stage hook
        ``name``: an override (Note [A direct runtime path])."""
        backends = {impl.plugin_name for impl in self._hook.hp_cp_backend.get_hookimpls()}
        impls = getattr(self._hook, name).get_hookimpls()
        return any(impl.plugin_name not in backends for impl in impls)

    def _stage(self, name: str, module: Any, stages: Any, **kwargs: Any) -> Any:
        if stages is None or self.overridden(name):
            return self._first(name, module, **kwargs)
        return getattr(stages, name.removeprefix("hp_cp_"))(**kwargs)

    def layer_spec(self, module: Any) -> Any:
        return self._first("hp_cp_layer_spec", module)

    def extract_ori_kv(self, module: Any, key: Any, stages: Any = None) -> Any:
        return self._stage("hp_cp_extract_ori_kv", module, stages, key=key)

    def compress_main(self, module: Any, x: Any, halo_x: Any, call: Any, stages: Any = None):
        return self._stage("hp_cp_compress_main", module, stages, x=x, halo_x=halo_x, call=call)

    def compress_indexer(
        self, module: Any, x: Any, halo_x: Any, call: Any, stages: Any = None
    ) -> Any:
        kwargs = {"x": x, "halo_x": halo_x, "call": call}
        return self._stage("hp_cp_compress_indexer", module, stages, **kwargs)

    def run_attention(
        self,
        module: Any,
        query: Any,
        ori_ext: Any,
        x: Any,
        qr: Any,
        call: Any,
        stages: Any = None,
    ) -> Any:
        kwargs = {"query": query, "ori_ext": ori_ext, "x": x, "qr": qr, "call": call}
        return self._stage("hp_cp_run_attention", module, stages, **kwargs)


def _fmt(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=1)
def get_plugin_host() -> PluginHost:
    """The process-wide host, built lazily on first use (no import-time side effects)."""
    return PluginHost()
