"""Plugin discovery, backend choice and every plugin error message.

Discovery runs through the real entry point of the installed test distribution ``hp-cp-fake``
(``fake = "hp_cp_fake.fake_backend"`` in group ``hp_cp``), and through injected
``importlib.metadata.EntryPoint`` objects for the broken plugins of ``tests/fakes``.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from types import SimpleNamespace

import numpy as np
import pytest
from _fake_run import run_cp

from hp_cp_core import (
    BackendConflictError,
    BackendLoadError,
    BackendNotFoundError,
    HpCpError,
    disable_cp,
    enable_cp,
    hookimpl,
)
from hp_cp_core.plugins import PluginHost
from hp_cp_fake import fake_backend as fb

MISSING = "No module named 'hp_cp_framework_that_does_not_exist'"
GUIDE = "see docs/writing-a-backend.md in the hp_cp repository."


def ep(name: str, value: str) -> md.EntryPoint:
    return md.EntryPoint(name=name, value=value, group="hp_cp")


class DistEntryPoint:
    """An entry point that comes from a named distribution (as installed ones do)."""

    def __init__(self, name: str, value: str, dist: str, version: str) -> None:
        self._ep = ep(name, value)
        self.name, self.value, self.group = name, value, "hp_cp"
        self.dist = SimpleNamespace(metadata={"Name": dist}, version=version)

    def load(self):
        return self._ep.load()


BROKEN = ep("broken", "hp_cp_fake.broken_import")
TYPO = ep("typo", "hp_cp_fake.unknown_hook")
FAKE = ep("fake", "hp_cp_fake.fake_backend")


def mesh(cp: int = 2, rank: int = 0) -> fb.FakeMesh:
    return fb.FakeMesh(fb.FakeWorld(cp), rank)


# -- discovery ---------------------------------------------------------------------------------


def test_installed_distribution_registers_the_fake_entry_point() -> None:
    eps = {e.name: e for e in md.entry_points(group="hp_cp")}
    assert eps["fake"].value == "hp_cp_fake.fake_backend"
    assert eps["fake"].dist.metadata["Name"] == "hp-cp-fake"


def test_autoload_discovers_the_fake_through_its_real_entry_point() -> None:
    host = PluginHost(autoload=True)
    status = host.statuses["fake"]
    assert (status.ok, status.dist, status.version, status.error) == (
        True,
        "hp-cp-fake",
        "0.4.0",
        None,
    )
    assert status.describe() == "fake (hp-cp-fake 0.4.0)"
    assert host.pm.get_plugin("fake") is fb
    # and a full CP forward runs through the discovered plugin
    x = np.random.default_rng(0).normal(size=(24, 6))
    results = run_cp(host, cp=3, x=x, r=4, window=5, layout="load_balanced")
    np.testing.assert_allclose(results[0].full, fb.single_device(fb.ToyAttention(window_size=5), x))


def test_broken_plugins_are_reported_by_name_and_do_not_stop_the_others() -> None:
    host = PluginHost(autoload=False, entry_points=[BROKEN, TYPO, FAKE])
    assert [s.name for s in host.installed()] == ["fake"]
    broken = {s.name: s for s in host.broken()}
    assert broken["broken"].error == f"ModuleNotFoundError: {MISSING}"
    assert isinstance(broken["broken"].exc, ModuleNotFoundError)
    assert broken["typo"].error.startswith(
        "unknown hook hp_cp_extract_ori_kvv (did you mean hp_cp_extract_ori_kv?); hp_cp hooks "
        "are hp_cp_backend, "
    )
    assert host.pm.get_plugin("typo") is None  # unregistered, so check_pending() passed
    assert {r["name"]: r["status"] for r in host.report()} == {
        "broken": "error",
        "typo": "error",
        "fake": "ok",
    }
    # the working backend still runs
    handle = enable_cp(fb.ToyAttention(), mesh(), plugins=host)
    assert handle.backend_name == "fake"
    disable_cp(handle)


def test_hp_cp_plugins_is_an_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HP_CP_PLUGINS", "fake")
    assert list(PluginHost().statuses) == ["fake"]
    assert list(PluginHost(autoload=False, entry_points=[BROKEN, FAKE]).statuses) == ["fake"]
    monkeypatch.setenv("HP_CP_PLUGINS", " broken , fake ")
    host = PluginHost(autoload=False, entry_points=[BROKEN, TYPO, FAKE])
    assert sorted(host.statuses) == ["broken", "fake"]
    monkeypatch.setenv("HP_CP_PLUGINS", "nope")
    assert PluginHost().statuses == {}
    monkeypatch.setenv("HP_CP_PLUGINS", "")  # empty means none
    assert PluginHost().statuses == {}
    assert PluginHost(autoload=True).statuses == {}


def test_hp_cp_disable_plugin_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "fake" in PluginHost().statuses  # autoload is the default
    monkeypatch.setenv("HP_CP_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert PluginHost().statuses == {}
    with pytest.raises(BackendNotFoundError):
        enable_cp(fb.ToyAttention(), mesh(), plugins=PluginHost())
    monkeypatch.setenv("HP_CP_PLUGINS", "fake")  # an explicit allow-list still loads
    assert list(PluginHost().statuses) == ["fake"]


def test_hp_cp_trace_plugins_prints_hook_calls(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("HP_CP_TRACE_PLUGINS", "1")
    host = PluginHost(autoload=False)
    host.add(fb, "fake")
    host.choose_backend(fb.ToyAttention())
    host.hooks.layer_spec(fb.ToyAttention())
    assert "hp_cp_layer_spec" in capsys.readouterr().err


# -- BackendNotFoundError --------------------------------------------------------------------


def test_not_found_lists_installed_broken_and_install_hints() -> None:
    host = PluginHost(autoload=False, entry_points=[BROKEN, FAKE])
    with pytest.raises(BackendNotFoundError) as err:
        enable_cp(object(), mesh(), plugins=host)
    assert str(err.value) == (
        "no hp_cp backend accepts a `builtins.object` (framework: builtins); installed: fake "
        f"(in-process); broken: broken (ModuleNotFoundError: {MISSING}). No installed backend "
        f"runs `builtins` modules; a backend for another framework or layer is a plugin: {GUIDE}"
    )


def test_not_found_with_nothing_installed(empty_host: PluginHost) -> None:
    with pytest.raises(BackendNotFoundError) as err:
        enable_cp(fb.ToyAttention(), mesh(), plugins=empty_host)
    assert str(err.value).startswith(
        "no hp_cp backend accepts a `hp_cp_fake.fake_backend.ToyAttention` (framework: "
        "hp_cp_fake); installed: none; broken: none. No installed backend runs `hp_cp_fake`"
    )


def _module_of(framework: str) -> object:
    cls = type("Attention", (), {"__module__": f"{framework}.nn.attention"})
    return cls()


@pytest.mark.parametrize(
    ("framework", "fix"),
    [
        ("torch", "Install the torch backend with `pip install hp-cp-torch`."),
        ("mindspore", "Install the mindspore backend with `pip install hp-cp-mindformers`."),
        (
            "jax",
            f"No installed backend runs `jax` modules; a backend for another framework "
            f"or layer is a plugin: {GUIDE}",
        ),
    ],
)
def test_not_found_names_the_framework_and_the_fix(
    empty_host: PluginHost, framework: str, fix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HP_CP_PLUGINS", "fake")
    with pytest.raises(BackendNotFoundError) as err:
        enable_cp(_module_of(framework), mesh(), plugins=empty_host)
    text = str(err.value)
    assert f"`{framework}.nn.attention.Attention` (framework: {framework})" in text
    assert text.endswith(f"{fix} Discovery switches: HP_CP_PLUGINS=fake."), text


def test_not_found_names_the_framework_of_a_subclass(empty_host: PluginHost) -> None:
    """A user's subclass of a framework's module class (``my_models.Attention(nn.Module)``)
    is that framework's module: the fix names its backend."""
    base = type("Module", (), {"__module__": "torch.nn.modules.module"})
    user = type("Attention", (base,), {"__module__": "my_models.layers"})
    with pytest.raises(BackendNotFoundError) as err:
        enable_cp(user(), mesh(), plugins=empty_host)
    text = str(err.value)
    assert "`my_models.layers.Attention` (framework: torch)" in text
    assert "Install the torch backend with `pip install hp-cp-torch`." in text


def test_named_backend_that_is_not_installed(host: PluginHost) -> None:
    with pytest.raises(BackendNotFoundError) as err:
        enable_cp(fb.ToyAttention(), mesh(), backend="nope", plugins=host)
    assert str(err.value) == (
        "backend='nope' is not an installed hp_cp backend; valid names: ['fake']."
    )
    with pytest.raises(BackendNotFoundError) as err:
        enable_cp(fb.ToyAttention(), mesh(), backend="torch", plugins=host)
    assert str(err.value) == (
        "backend='torch' is not an installed hp_cp backend; valid names: ['fake']. "
        "Install it with `pip install hp-cp-torch`."
    )
    with pytest.raises(BackendNotFoundError, match=re.escape("`pip install hp-cp-mindformers`")):
        enable_cp(fb.ToyAttention(), mesh(), backend="mindformers", plugins=PluginHost())


def test_named_backend_that_declines_the_module(host: PluginHost) -> None:
    with pytest.raises(BackendNotFoundError) as err:
        enable_cp(object(), mesh(), backend="fake", plugins=host)
    assert str(err.value).startswith(
        "backend 'fake' does not accept a `object`; expected a module it recognises. "
        "no hp_cp backend accepts a `builtins.object` (framework: builtins); installed: fake "
        "(in-process)"
    )


# -- BackendLoadError ------------------------------------------------------------------------


def test_named_broken_backend_raises_load_error_from_the_original() -> None:
    host = PluginHost(autoload=False, entry_points=[BROKEN, FAKE])
    with pytest.raises(BackendLoadError) as err:
        enable_cp(fb.ToyAttention(), mesh(), backend="broken", plugins=host)
    assert str(err.value) == (
        f'Error loading hp_cp backend "broken" from in-process: ModuleNotFoundError: {MISSING}'
    )
    assert isinstance(err.value.__cause__, ModuleNotFoundError)
    assert err.value.__cause__ is host.statuses["broken"].exc


def test_load_error_names_the_distribution() -> None:
    broken = DistEntryPoint("torch", "hp_cp_fake.broken_import", "hp-cp-torch", "0.3")
    host = PluginHost(autoload=False, entry_points=[broken, FAKE])
    with pytest.raises(BackendLoadError) as err:
        enable_cp(fb.ToyAttention(), mesh(), backend="torch", plugins=host)
    assert str(err.value) == (
        f'Error loading hp_cp backend "torch" from hp-cp-torch 0.3: ModuleNotFoundError: {MISSING}'
    )
    assert isinstance(err.value.__cause__, ModuleNotFoundError)


def test_named_plugin_with_an_unknown_hook_raises_load_error() -> None:
    host = PluginHost(autoload=False, entry_points=[TYPO, FAKE])
    with pytest.raises(BackendLoadError) as err:
        enable_cp(fb.ToyAttention(), mesh(), backend="typo", plugins=host)
    assert str(err.value).startswith(
        'Error loading hp_cp backend "typo" from in-process: unknown hook hp_cp_extract_ori_kvv '
        "(did you mean hp_cp_extract_ori_kv?)"
    )
    assert isinstance(err.value.__cause__, HpCpError)


def test_plugin_that_fails_to_register_is_reported() -> None:
    host = PluginHost(autoload=False)
    host.add(fb, "fake")
    host.add(fb, "again")  # pluggy refuses the same plugin object twice
    assert host.statuses["again"].ok is False
    assert host.statuses["again"].error.startswith(
        "ValueError: Plugin already registered under a different name: again="
    )


# -- BackendConflictError --------------------------------------------------------------------


class SecondClaimer:
    """Another plugin that also claims the toy layer."""

    @hookimpl
    def hp_cp_backend(self, module):
        return fb.BACKEND if isinstance(module, fb.ToyAttention) else None


def test_two_plugins_claiming_one_module_conflict(host: PluginHost) -> None:
    host.add(SecondClaimer(), "fake2")
    with pytest.raises(BackendConflictError) as err:
        enable_cp(fb.ToyAttention(), mesh(), plugins=host)
    assert str(err.value) == (
        "2 hp_cp backends claim a `ToyAttention`: fake (in-process), fake2 (in-process). "
        "Expected exactly one. Choose with enable_cp(..., backend='fake') or uninstall one of "
        "them."
    )
    handle = enable_cp(fb.ToyAttention(), mesh(), backend="fake", plugins=host)  # the way out
    assert handle.backend_name == "fake"
    disable_cp(handle)


def test_two_distributions_registering_one_name_conflict() -> None:
    first = DistEntryPoint("torch", "hp_cp_fake.dup_torch", "hp-cp-torch", "0.3")
    second = DistEntryPoint("torch", "hp_cp_fake.dup_torch", "hp-cp-torch-nightly", "0.4")
    host = PluginHost(autoload=False, entry_points=[first, second, FAKE])
    expected = (
        "two plugins register the hp_cp backend name 'torch': torch (hp-cp-torch 0.3) and "
        "torch (hp-cp-torch-nightly 0.4). Expected one distribution per backend name; "
        "uninstall one of them (pip uninstall ...)."
    )
    with pytest.raises(BackendConflictError) as err:
        enable_cp(fb.ToyAttention(), mesh(), backend="torch", plugins=host)
    assert str(err.value) == expected
    rows = [(r["name"], r["dist"], r["status"]) for r in host.report()]
    assert ("torch", "hp-cp-torch", "ok") in rows
    assert ("torch", "hp-cp-torch-nightly", "error") in rows
    # the fake is not involved, so it still runs
    handle = enable_cp(fb.ToyAttention(), mesh(), plugins=host)
    disable_cp(handle)


def test_a_claiming_backend_whose_name_is_duplicated_conflicts() -> None:
    dup = DistEntryPoint("fake", "hp_cp_fake.fake_backend", "hp-cp-fake-fork", "9.9")
    host = PluginHost(autoload=False)
    host.discover([*md.entry_points(group="hp_cp", name="fake"), dup])
    with pytest.raises(BackendConflictError) as err:
        enable_cp(fb.ToyAttention(), mesh(), plugins=host)
    assert str(err.value).startswith(
        "two plugins register the hp_cp backend name 'fake': fake (hp-cp-fake 0.4.0) and "
        "fake (hp-cp-fake-fork 9.9)."
    )
