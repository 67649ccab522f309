"""AdapterHooks: the shared hook implementations of adapter-driven backends."""

from __future__ import annotations

import json  # noqa: F401 - "json" plays the framework that is already imported
import sys

from hp_cp_core.adapters import AdapterHooks, InstallingBackend


class Layer:
    def __init__(self) -> None:
        self.children: list = []


class Model:
    def __init__(self, children: list) -> None:
        self.children = children


class Adapter:
    def __init__(self, module: Layer) -> None:
        self.module = module

    def layer_spec(self):
        return ("spec", self.module)

    def extract_ori_kv(self, key):
        return ("kv", key)

    def compress_main(self, x, halo_x, call):
        return ("main", x, halo_x, call)

    def compress_indexer(self, x, halo_x, call):
        return ("indexer", x, halo_x, call)

    def run_attention(self, query, ori_ext, x, qr, call):
        return ("attn", query, ori_ext, x, qr, call)

    def make_forward(self, cp_forward, group):
        return ("forward", cp_forward)


class Group:
    def __init__(self, size: int) -> None:
        self.size = size


def make_hooks(framework: str = "json") -> AdapterHooks:
    installed = []

    def install_forward(layer, forward):
        installed.append((layer, forward))
        return lambda: installed.remove((layer, forward))

    hooks = AdapterHooks(
        framework=framework,
        adapter_for=lambda m: Adapter(m) if isinstance(m, Layer) else None,
        make_backend="hp_cp_core.adapters:InstallingBackend",  # resolved lazily
        children=lambda m: getattr(m, "children", ()),
        install_forward=install_forward,
    )
    hooks.installed = installed
    return hooks


def test_every_stage_delegates_to_the_adapter_and_declines_foreign_modules():
    hooks, layer = make_hooks(), Layer()
    assert hooks.hp_cp_layer_spec(layer) == ("spec", layer)
    assert hooks.hp_cp_extract_ori_kv(layer, "k") == ("kv", "k")
    assert hooks.hp_cp_compress_main(layer, "x", "h", "c") == ("main", "x", "h", "c")
    assert hooks.hp_cp_compress_indexer(layer, "x", "h", "c") == ("indexer", "x", "h", "c")
    assert hooks.hp_cp_run_attention(layer, "q", "o", "x", "r", "c")[0] == "attn"
    other = object()
    assert hooks.hp_cp_layer_spec(other) is None
    assert hooks.hp_cp_extract_ori_kv(other, "k") is None
    assert hooks.hp_cp_run_attention(other, "q", "o", "x", "r", "c") is None
    assert hooks.hp_cp_backend(other) is None


def test_backend_is_built_lazily_and_finds_layers_inside_a_model():
    hooks, model = make_hooks(), Model([Layer(), object(), Layer()])
    backend = hooks.hp_cp_backend(model)
    assert isinstance(backend, InstallingBackend)
    assert backend.find_layers(model) == [model.children[0], model.children[2]]


def test_install_keeps_the_original_path_for_a_group_of_one():
    hooks, layer = make_hooks(), Layer()
    undo = hooks.install(layer, "cp", Group(1))
    assert hooks.installed == []
    undo()
    undo = hooks.install(layer, "cp", Group(2))
    assert hooks.installed == [(layer, ("forward", "cp"))]
    undo()
    assert hooks.installed == []


def test_nothing_is_claimed_while_the_framework_is_not_imported():
    name = "hp_cp_framework_never_imported"
    assert name not in sys.modules
    hooks = make_hooks(framework=name)
    assert hooks.hp_cp_backend(Layer()) is None
    assert hooks.hp_cp_layer_spec(Layer()) is None
    assert hooks.find_layers(Layer()) == []


def test_the_0_4_names_are_the_runner_hooks() -> None:
    """``hp_cp_core.adapters.AdapterHooks(adapter_for=)`` (0.4) is ``RunnerHooks(runner_for=)``
    under its old names: a backend on API 0.2 runs unchanged."""
    from hp_cp_core import runners

    assert issubclass(AdapterHooks, runners.RunnerHooks)
    assert InstallingBackend is runners.InstallingBackend
    hooks = make_hooks()
    layer = Layer()
    assert hooks.adapter(layer).module is layer and hooks.runner(layer).module is layer


# ------------------------------------------------- Note [A direct runtime path]


def _host_with_runner_hooks():
    """A host whose one backend is ``make_hooks()`` (runner-delegating stage hooks), and a
    list recording every hook pluggy calls."""
    from hp_cp_core.plugins import PluginHost

    host = PluginHost(autoload=False)
    host.add(make_hooks(), "runners")
    called: list[str] = []
    host.pm.add_hookcall_monitoring(lambda name, *_: called.append(name), lambda *_: None)
    return host, called


def test_a_stage_object_is_called_directly_without_a_hook_call():
    """Handed the runner (``stages``), every stage goes straight to it: no pluggy call."""
    host, called = _host_with_runner_hooks()
    hooks, layer = host.hooks, Layer()
    stages = Adapter(layer)
    assert hooks.extract_ori_kv(layer, "k", stages) == ("kv", "k")
    assert hooks.compress_main(layer, "x", "h", "c", stages) == ("main", "x", "h", "c")
    assert hooks.compress_indexer(layer, "x", "h", "c", stages) == ("indexer", "x", "h", "c")
    out = hooks.run_attention(layer, "q", "o", "x", None, "c", stages)
    assert out == ("attn", "q", "o", "x", None, "c")
    assert called == []
    import hp_cp_fake.fake_backend as fake  # another backend: its stages answer only its own

    host.add(fake, "fake")
    assert hooks.run_attention(layer, "q", "o", "x", None, "c", stages)[0] == "attn"
    assert called == []
    assert hooks.extract_ori_kv(layer, "k") == ("kv", "k")  # no stage object: the hook, as 0.4
    assert called == ["hp_cp_extract_ori_kv"]


def test_a_plugin_that_overrides_a_stage_takes_it_over_from_the_stage_object():
    """A ``tryfirst`` plugin implementing one stage is asked first for that stage even when
    the caller handed a stage object; a module it declines reaches the runner through the
    hooks; the other stages stay direct."""
    from hp_cp_core import hookimpl

    class Override:
        @hookimpl(tryfirst=True)
        def hp_cp_run_attention(self, module, query, ori_ext, x, qr, call):
            return "override" if module.children == ["mine"] else None

    host, called = _host_with_runner_hooks()
    host.add(Override(), "override")
    hooks, layer, mine = host.hooks, Layer(), Layer()
    mine.children = ["mine"]
    assert hooks.overridden("hp_cp_run_attention")
    assert not hooks.overridden("hp_cp_compress_main")
    assert hooks.run_attention(mine, "q", "o", "x", None, "c", Adapter(mine)) == "override"
    out = hooks.run_attention(layer, "q", "o", "x", None, "c", Adapter(layer))
    assert out == ("attn", "q", "o", "x", None, "c")  # declined: the runner, via its hook
    assert hooks.compress_main(layer, "x", "h", "c", Adapter(layer))[0] == "main"
    assert called == ["hp_cp_run_attention", "hp_cp_run_attention"]
