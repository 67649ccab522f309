"""0.4's name of :mod:`hp_cp_core.runners`, kept so that backends written against backend
API 0.2 run unchanged: ``AdapterHooks(adapter_for=...)`` is :class:`~hp_cp_core.runners.RunnerHooks`
with ``runner_for`` under its old keyword ("adapter" meant the object that runs a module's
stages, which the core now calls its runner; a model adapter is the framework's model spec).
New code imports :mod:`hp_cp_core.runners`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hp_cp_core.runners import InstallingBackend, RunnerHooks

__all__ = ["AdapterHooks", "InstallingBackend"]


class AdapterHooks(RunnerHooks):
    """:class:`~hp_cp_core.runners.RunnerHooks` under its 0.4 name and keyword."""

    def __init__(
        self,
        *,
        framework: str,
        adapter_for: Callable[[Any], Any] | str,
        make_backend: Callable[..., Any] | str,
        children: Callable[[Any], Iterable[Any]],
        install_forward: Callable[[Any, Any], Callable[[], None]] | str,
    ) -> None:
        super().__init__(
            framework=framework,
            runner_for=adapter_for,
            make_backend=make_backend,
            children=children,
            install_forward=install_forward,
        )

    def adapter(self, module: Any) -> Any:
        """:meth:`~hp_cp_core.runners.RunnerHooks.runner` under its 0.4 name."""
        return self.runner(module)
