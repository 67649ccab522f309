"""Backend API versions: the ``hp_cp_backend_api`` hook, a 0.1 backend adapted (placeholder
tokens, ``DeprecationWarning``) or refused with one ``HpCpError``, and the ``api`` column of
``python -m hp_cp_core``. The 0.1 backend itself also runs the contract suite (driver
``legacy``, the core nox session)."""

from __future__ import annotations

import importlib.metadata as md
import json
import warnings
from typing import Any

import numpy as np
import pytest

from hp_cp_core import BACKEND_API, HpCpError, disable_cp, enable_cp
from hp_cp_core import __main__ as cli
from hp_cp_core.plugins import PluginHost
from hp_cp_core.testing import ThreadWorld
from hp_cp_core.versions import MIGRATION, LegacyGroup, api_status, check_group_api
from hp_cp_fake import fake_backend as fb
from hp_cp_fake import future_api
from hp_cp_fake import legacy_backend as lb


def host_with(**plugins: Any) -> PluginHost:
    host = PluginHost(autoload=False)
    for name, plugin in plugins.items():
        host.add(plugin, name)
    return host


def test_hook_hp_cp_backend_api() -> None:
    host = host_with(fake=fb, legacy=lb, future=future_api)
    assert BACKEND_API == "0.2"
    assert fb.hp_cp_backend_api() == BACKEND_API
    assert host.backend_api("fake") == "0.2"
    assert host.backend_api("legacy") == "0.1"  # no hook: written before it existed
    assert host.backend_api("future") == "1.0"
    assert [api_status(v) for v in ("0.2", "0.1", "1.0", "0.3")] == [
        "current",
        "adapted",
        "unusable",
        "unusable",
    ]


def test_a_0_1_backend_is_adapted_with_a_deprecation_warning() -> None:
    host = host_with(legacy=lb)
    x = np.random.default_rng(3).normal(size=(24, 6))
    world = ThreadWorld(2, timeout=30)

    def layer() -> lb.LegacyToyAttention:
        return lb.LegacyToyAttention(compress_ratio=4, window_size=5, index_topk=3)

    def rank_fn(rank: int) -> tuple[Any, type]:
        lay = layer()
        handle = enable_cp(lay, world.mesh(rank), plugins=host)
        try:
            return handle.unshard(lay(handle.shard(x, 0)), 0), type(handle.group)
        finally:
            disable_cp(handle)

    with pytest.warns(DeprecationWarning, match="backend API 0.1") as record:
        got = world.run(rank_fn)
    assert any("Migrating a backend from 0.1 to 0.2" in str(w.message) for w in record)
    want = fb.single_device(layer(), x)
    for out, group_type in got:
        assert group_type is LegacyGroup
        np.testing.assert_allclose(out, want, rtol=1e-12)


class CountingGroup:
    """A 0.1-style group that records every collective it is asked to run."""

    rank, size = 0, 2

    def __init__(self, *, meta: bool = True, tokens: bool = False) -> None:
        self.calls: list[str] = []
        if not meta:
            self.all_gather_meta = None  # not callable: missing
        if tokens:
            self.begin_order = lambda anchor: None
            self.end_order = lambda output, token: output

    def exchange_rows(self, items: Any) -> list:
        self.calls.append("exchange_rows")
        return []

    def all_gather_rows(self, tensor: Any) -> Any:
        self.calls.append("all_gather_rows")
        return tensor

    def all_gather_dim(self, tensor: Any, dim: int) -> Any:
        self.calls.append("all_gather_dim")
        return tensor

    def all_gather_meta(self, values: Any) -> Any:
        self.calls.append("all_gather_meta")
        return values

    def stats(self) -> dict:
        return {}


def test_a_0_1_group_missing_methods_is_refused_naming_them() -> None:
    group = CountingGroup(meta=False)
    with pytest.raises(HpCpError) as err:
        check_group_api(group, "0.1", "mine", fb.ToyAttention())
    msg = str(err.value)
    assert "has no all_gather_meta" in msg
    assert "Missing for 0.2: begin_order, end_order" in msg
    assert MIGRATION in msg and "Migrating a backend from 0.1 to 0.2" in msg
    assert group.calls == []  # refused before any collective


def test_a_0_1_group_for_an_eager_autograd_framework_is_refused() -> None:
    Torchish = type("Attention", (), {"__module__": "torch.nn.modules.fake"})
    with pytest.raises(HpCpError, match="cannot be adapted for a torch module") as err:
        check_group_api(CountingGroup(), "0.1", "mine", Torchish())
    assert "begin_order, end_order" in str(err.value) and MIGRATION in str(err.value)


def test_a_current_plugin_whose_group_lacks_tokens_is_refused() -> None:
    with pytest.raises(HpCpError, match="declares hp_cp backend API 0.2") as err:
        check_group_api(CountingGroup(), "0.2", "mine", fb.ToyAttention())
    assert "has no begin_order, end_order" in str(err.value)
    group = CountingGroup(tokens=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a current group: no warning, no wrapper
        assert check_group_api(group, "0.2", "mine", fb.ToyAttention()) is group


def test_an_unknown_backend_api_is_refused_before_its_group_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = host_with(future=future_api)
    made = []
    monkeypatch.setattr(fb.BACKEND, "group", lambda mesh: made.append(mesh))
    with pytest.raises(HpCpError) as err:
        enable_cp(future_api.FutureLayer(), object(), plugins=host)
    assert str(err.value).startswith(
        "backend 'future' implements hp_cp backend API '1.0'; this hp-cp-core implements 0.2 "
        "and adapts 0.1."
    )
    assert made == []


def test_cli_api_column(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    real = md.entry_points
    extra = [
        md.EntryPoint(name="future", value="hp_cp_fake.future_api", group="hp_cp"),
    ]

    def entry_points(**kwargs: Any) -> Any:
        eps = list(real(**kwargs))
        return [*eps, *extra] if kwargs.get("group") == "hp_cp" else eps

    monkeypatch.setattr(md, "entry_points", entry_points)
    monkeypatch.setenv("HP_CP_PLUGINS", "fake,legacy,future")
    assert cli.main([]) == 0
    table = capsys.readouterr().out.splitlines()[1:]
    assert table[0].split() == ["backend", "distribution", "version", "api", "status"]
    rows = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert rows["fake"] == ["hp-cp-fake", "0.4.0", "0.2", "current", "ok"]
    assert rows["legacy"] == ["hp-cp-fake", "0.4.0", "0.1", "adapted", "ok"]
    assert rows["future"] == ["-", "-", "1.0", "unusable", "ok"]
    assert cli.main(["--json"]) == 0
    got = {r["name"]: r for r in json.loads(capsys.readouterr().out)["backends"]}
    assert {n: (r["backend_api"], r["api_status"]) for n, r in got.items()} == {
        "fake": ("0.2", "current"),
        "legacy": ("0.1", "adapted"),
        "future": ("1.0", "unusable"),
    }
