"""Fixtures of the framework-free core tests: a fresh plugin host with only the fake backend."""

from __future__ import annotations

import pytest

from hp_cp_core.plugins import PluginHost
from hp_cp_fake import fake_backend

ENV_SWITCHES = ("HP_CP_PLUGINS", "HP_CP_DISABLE_PLUGIN_AUTOLOAD", "HP_CP_TRACE_PLUGINS")


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the caller's plugin switches (each test sets the ones it needs)."""
    for name in ENV_SWITCHES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def empty_host() -> PluginHost:
    """A plugin host that loaded nothing (autoload off)."""
    return PluginHost(autoload=False)


@pytest.fixture
def host(empty_host: PluginHost) -> PluginHost:
    """A fresh plugin host with autoload off and the fake backend registered as ``fake``."""
    empty_host.add(fake_backend, "fake")  # same as _fake_run.fake_host()
    try:
        yield empty_host
    finally:
        empty_host.remove("fake")
