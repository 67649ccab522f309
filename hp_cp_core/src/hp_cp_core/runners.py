"""Hook implementations shared by backends whose modules are driven by *runner* objects.

A backend that maps each module it knows to a runner (the object that runs that module's
stages: ``layer_spec()``, ``extract_ori_kv(key)``, ``compress_main(x, halo_x, call)``,
``compress_indexer(...)``, ``run_attention(query, ori_ext, x, qr, call)``,
``make_forward(cp_forward, group)``) needs the same six hooks and the same install rule;
:class:`RunnerHooks` is them, once. A plugin module exposes its bound methods as
module-level hooks (``hp_cp_torch/_plugin.py``, which ``docs/writing-a-backend.md`` shows
whole)::

    _HOOKS = RunnerHooks(
        framework="torch",
        runner_for="hp_cp_torch.adapter:runner_for",
        make_backend="hp_cp_torch.adapter:make_backend",
        children=_children,
        install_forward="hp_cp_torch.adapter:install_forward",
    )
    hp_cp_backend = _HOOKS.hp_cp_backend
    ...

``framework`` is checked in ``sys.modules`` before anything else, so discovery never imports
a framework, and a module is only claimed when its framework is already loaded. The forward
``make_forward`` returns may hand the core's forward the runner itself,
``cp_forward(query, key, x, call=call, stages=self)``: its stages are then called directly,
without these hooks, unless a plugin overrides one (Note [A direct runtime path] in
:mod:`hp_cp_core.plugins`).

"Runner" is the core's word for that object; a framework's *model adapter* (hp_cp_torch's
``ModelAdapter``: the model's spec) is another thing, which the framework's runner drives.
0.4 called this module ``hp_cp_core.adapters`` and the class ``AdapterHooks(adapter_for=)``;
both stay as aliases (:mod:`hp_cp_core.adapters`), so backends on API 0.2 run unchanged.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

from hp_cp_core import hookimpl
from hp_cp_core.versions import BACKEND_API


class RunnerHooks:
    """The six hp_cp hooks, delegating every stage to the module's runner.

    Args:
        framework: top-level module name of the framework (``"torch"``, ``"mindspore"``).
        runner_for: ``module -> runner`` or ``None`` (imports backend code lazily).
        make_backend: ``(find_layers, install) -> Backend``.
        children: ``module -> iterable of sub-modules`` (for a whole model).
        install_forward: ``(layer, forward) -> undo`` replacing the layer's forward.

    ``runner_for``, ``make_backend`` and ``install_forward`` may also be given as
    ``"package.module:name"`` strings, imported on first use (after the framework check), so
    a plugin module stays free of framework imports.
    """

    def __init__(
        self,
        *,
        framework: str,
        runner_for: Callable[[Any], Any] | str,
        make_backend: Callable[..., Any] | str,
        children: Callable[[Any], Iterable[Any]],
        install_forward: Callable[[Any, Any], Callable[[], None]] | str,
    ) -> None:
        self.framework = framework
        self._runner_for = _lazy(runner_for)
        self._make_backend = _lazy(make_backend)
        self._children = children
        self._install_forward = _lazy(install_forward)

    def runner(self, module: Any) -> Any:
        """The module's runner, or ``None`` when this backend does not own it."""
        if sys.modules.get(self.framework) is None:
            return None
        return self._runner_for(module)

    def find_layers(self, module: Any) -> list[Any]:
        """Every sub-module (the module itself included) this backend has a runner for."""
        if self.runner(module) is not None:
            return [module]
        if sys.modules.get(self.framework) is None:
            return []
        return [m for m in self._children(module) if self.runner(m) is not None]

    def install(self, layer: Any, cp_forward: Any, group: Any) -> Callable[[], None]:
        """Route the layer's forward through CP; with a group of one the original path stays
        unless the config's ``single_rank_bypass`` is off."""
        config = getattr(cp_forward, "config", None)
        if group.size == 1 and (config is None or config.single_rank_bypass):
            return lambda: None
        return self._install_forward(layer, self.runner(layer).make_forward(cp_forward, group))

    @hookimpl
    def hp_cp_backend_api(self) -> str:
        """The backend API these hooks implement: the core's own (:mod:`hp_cp_core.versions`)."""
        return BACKEND_API

    @hookimpl
    def hp_cp_backend(self, module: Any) -> Any:
        if not self.find_layers(module):
            return None
        return self._make_backend(self.find_layers, self.install)

    @hookimpl
    def hp_cp_layer_spec(self, module: Any) -> Any:
        runner = self.runner(module)
        return None if runner is None else runner.layer_spec()

    @hookimpl
    def hp_cp_extract_ori_kv(self, module: Any, key: Any) -> Any:
        runner = self.runner(module)
        return None if runner is None else runner.extract_ori_kv(key)

    @hookimpl
    def hp_cp_compress_main(self, module: Any, x: Any, halo_x: Any, call: Any) -> Any:
        runner = self.runner(module)
        return None if runner is None else runner.compress_main(x, halo_x, call)

    @hookimpl
    def hp_cp_compress_indexer(self, module: Any, x: Any, halo_x: Any, call: Any) -> Any:
        runner = self.runner(module)
        return None if runner is None else runner.compress_indexer(x, halo_x, call)

    @hookimpl
    def hp_cp_run_attention(
        self, module: Any, query: Any, ori_ext: Any, x: Any, qr: Any, call: Any
    ) -> Any:
        runner = self.runner(module)
        return None if runner is None else runner.run_attention(query, ori_ext, x, qr, call)


def _lazy(target: Callable[..., Any] | str) -> Callable[..., Any]:
    """``target`` itself, or a callable importing ``"module:name"`` on its first call."""
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module_name), attr)(*args, **kwargs)

    return call


class InstallingBackend:
    """Base for backends built by :class:`RunnerHooks`: layer finding and forward install.

    Subclasses add the framework's ``group(mesh)`` and tensor ops.
    """

    name = "?"

    def __init__(self, find: Callable[[Any], list[Any]], install: Callable[..., Any]) -> None:
        self._find = find
        self._install = install

    def find_layers(self, module: Any) -> list[Any]:
        return self._find(module)

    def install(self, layer: Any, cp_forward: Any, group: Any) -> Any:
        return self._install(layer, cp_forward, group)

    def uninstall(self, layer: Any, token: Any) -> None:
        token()
