"""``enable_cp`` / ``disable_cp`` on the fake backend: one handle per module, exact restore."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hp_cp_core import (
    DeepSeekV4CPConfig,
    DeepSeekV4CPForward,
    HpCpError,
    LayerSpec,
    disable_cp,
    enable_cp,
    hookimpl,
)
from hp_cp_core.plugins import PluginHost
from hp_cp_fake import fake_backend as fb


def test_second_enable_on_the_same_module_raises(host: PluginHost) -> None:
    layer = fb.ToyAttention()
    first_mesh = fb.FakeMesh(fb.FakeWorld(2), 0)
    handle = enable_cp(layer, first_mesh, plugins=host)
    with pytest.raises(HpCpError) as err:
        enable_cp(layer, fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    assert str(err.value) == (
        f"`ToyAttention` already runs under CP (enabled with mesh {first_mesh!r}); call "
        "disable_cp(handle) on the first handle before enabling it again."
    )
    assert layer._hp_cp_handle is handle  # the first handle is untouched
    assert isinstance(layer.cp_forward, DeepSeekV4CPForward)
    disable_cp(handle)
    again = enable_cp(layer, fb.FakeMesh(fb.FakeWorld(2), 1), plugins=host)  # allowed again
    assert again.cp_rank == 1
    disable_cp(again)


def test_disable_restores_the_original_forward_exactly(host: PluginHost) -> None:
    layer = fb.ToyAttention(compress_ratio=4, window_size=5)

    def original(*args, **kwargs):  # whatever forward the layer had before
        raise AssertionError("not called")

    layer.cp_forward = original
    before = dict(vars(layer))
    handle = enable_cp(layer, fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    assert isinstance(layer.cp_forward, DeepSeekV4CPForward)
    assert layer._hp_cp_handle is handle
    disable_cp(handle)
    assert layer.cp_forward is original
    assert vars(layer).keys() == before.keys()
    assert all(vars(layer)[k] is v for k, v in before.items())
    assert handle.active is False and handle._tokens == []
    disable_cp(handle)  # a second call does nothing
    assert layer.cp_forward is original


def test_disable_after_a_cp_forward_gives_back_the_single_device_layer(host: PluginHost) -> None:
    x = np.random.default_rng(3).normal(size=(24, 6))
    ref = fb.single_device(fb.ToyAttention(window_size=6), x)
    world = fb.FakeWorld(2)

    def rank_fn(rank: int) -> np.ndarray:
        layer = fb.ToyAttention(window_size=6)
        handle = enable_cp(layer, fb.FakeMesh(world, rank), plugins=host)
        handle.unshard(layer(handle.shard(x, 0)), 0)
        disable_cp(handle)
        assert layer.cp_forward is None and "_hp_cp_handle" not in vars(layer)
        return layer(x)  # the whole sequence again, on one device

    for out in world.run(rank_fn):
        np.testing.assert_array_equal(out, ref)


def test_enable_reports_the_layers_and_stats(host: PluginHost) -> None:
    layer = fb.ToyAttention(compress_ratio=128, window_size=128)
    handle = enable_cp(
        layer,
        fb.FakeMesh(fb.FakeWorld(3), 2),
        DeepSeekV4CPConfig(layout="load_balanced"),
        plugins=host,
    )
    assert handle.layers == [(layer, LayerSpec(compress_ratio=128, window_size=128))]
    assert (handle.cp_rank, handle.cp_size, handle.backend_name) == (2, 3, "fake")
    stats = handle.stats()
    assert stats["layout"] == "load_balanced" and stats["layers"] == 1
    assert stats["plan_cache"] == {"plans": 0, "capacity": 64, "hits": 0, "misses": 0}
    disable_cp(handle)


def test_config_must_be_a_config(host: PluginHost) -> None:
    with pytest.raises(HpCpError) as err:
        enable_cp(fb.ToyAttention(), fb.FakeMesh(fb.FakeWorld(2), 0), {"layout": "x"}, plugins=host)
    assert str(err.value) == (
        "config must be a CPConfig, got dict; build one with "
        "CPConfig(layout=..., attention_kernel=...)."
    )


def test_backend_rejects_a_mesh_it_cannot_use(host: PluginHost) -> None:
    with pytest.raises(HpCpError, match=re.escape("the fake backend needs a FakeMesh, got str.")):
        enable_cp(fb.ToyAttention(), "cp", plugins=host)


class BadSpec:
    @hookimpl(tryfirst=True)
    def hp_cp_layer_spec(self, module):
        return {"compress_ratio": 4}


def test_layer_spec_must_be_a_layer_spec(host: PluginHost) -> None:
    host.add(BadSpec(), "badspec")
    with pytest.raises(HpCpError) as err:
        enable_cp(fb.ToyAttention(), fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    assert str(err.value) == (
        "hp_cp_layer_spec returned a dict for `ToyAttention`; expected a hp_cp_core.LayerSpec, "
        "got {'compress_ratio': 4}. Return LayerSpec(compress_ratio=..., window_size=..., "
        "has_indexer=...) from the backend's hook."
    )


def test_a_stage_hook_nobody_answers_names_hook_and_module() -> None:
    host = PluginHost(autoload=False)
    host.add(fb, "fake")
    world = fb.FakeWorld(2)
    x = np.random.default_rng(0).normal(size=(16, 6))
    layers = [fb.ToyAttention() for _ in range(2)]
    handles = [enable_cp(layers[k], fb.FakeMesh(world, k), plugins=host) for k in range(2)]
    host.remove("fake")  # the backend went away after enable_cp

    def rank_fn(rank: int) -> None:
        layers[rank](handles[rank].shard(x, 0))

    with pytest.raises(HpCpError) as err:
        world.run(rank_fn)
    assert str(err.value) == (
        "no hp_cp plugin implements hp_cp_extract_ori_kv for a `ToyAttention`; expected the "
        "module's backend to answer. Is the backend that enabled it still registered?"
    )


def test_a_group_of_one_keeps_the_forward_until_the_cp_path_is_asked_for(
    host: PluginHost,
) -> None:
    """``single_rank_bypass``: a group of one keeps the layer's own forward (``bypassed``)
    until ``use_cp_path()`` (what the batch helpers call for packed input); ``disable_cp``
    then restores the original exactly."""
    layer = fb.ToyAttention(compress_ratio=4, window_size=5)

    def original(*args, **kwargs):
        raise AssertionError("not called")

    layer.cp_forward = original
    handle = enable_cp(layer, fb.FakeMesh(fb.FakeWorld(1), 0), plugins=host)
    assert handle.bypassed and layer.cp_forward is original
    handle.use_cp_path()
    assert not handle.bypassed and isinstance(layer.cp_forward, DeepSeekV4CPForward)
    assert layer.cp_forward.config.single_rank_bypass is False
    handle.use_cp_path()  # nothing left to switch
    disable_cp(handle)
    assert layer.cp_forward is original
    off = enable_cp(
        layer,
        fb.FakeMesh(fb.FakeWorld(1), 0),
        DeepSeekV4CPConfig(single_rank_bypass=False),
        plugins=host,
    )
    assert not off.bypassed and isinstance(layer.cp_forward, DeepSeekV4CPForward)
    disable_cp(off)
    more = enable_cp(layer, fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    assert not more.bypassed
    disable_cp(more)


def test_prepare_module_runs_once_before_any_install_and_its_error_leaves_nothing(
    host: PluginHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend's optional ``prepare_module(module, layers, handle)``: called once per
    ``enable_cp`` with the layers found, before any layer is installed; what it registers
    with ``handle.on_disable`` runs in ``disable_cp``; an ``HpCpError`` it raises leaves
    every forward as it was."""
    layer = fb.ToyAttention(compress_ratio=4, window_size=5)
    seen: list[tuple] = []

    def prepare(self, module, layers, handle):  # noqa: ANN001, ANN202 - the backend's method
        seen.append((module, list(layers), isinstance(layer.cp_forward, DeepSeekV4CPForward)))
        handle.on_disable(lambda: seen.append("undone"))

    monkeypatch.setattr(fb.FakeBackend, "prepare_module", prepare, raising=False)
    before = dict(vars(layer))
    handle = enable_cp(layer, fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    assert seen == [(layer, [layer], False)]  # once, with its layer, nothing installed yet
    disable_cp(handle)
    assert seen[-1] == "undone"

    def refuse(self, module, layers, handle):  # noqa: ANN001, ANN202
        raise HpCpError("this model needs something the backend cannot do")

    monkeypatch.setattr(fb.FakeBackend, "prepare_module", refuse, raising=False)
    with pytest.raises(HpCpError, match="cannot do"):
        enable_cp(layer, fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    assert vars(layer).keys() == before.keys()
    assert all(vars(layer)[k] is v for k, v in before.items())
    assert getattr(layer, "_hp_cp_handle", None) is None
