"""The framework-free blocks of docs/ (``<!-- tested: NAME -->``), run or checked here
(``nox -s core``): the backend guide's hooks and layer-forward fragments on the numpy fake
backend and thread ranks, the testing kit's examples, the excerpts of shipped files against
those files, the diagrams' and the listing's names against the code and the tree, printed
output against the code that prints it. The torch pages' blocks run in
``tests/torch/test_doc_blocks.py``."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from hp_cp_core import CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_core.plugins import PluginHost
from hp_cp_core.testing import ThreadWorld
from hp_cp_fake import fake_backend as fb

ROOT = Path(__file__).resolve().parents[2]


def _load_doc_blocks():
    spec = importlib.util.spec_from_file_location("doc_blocks", ROOT / "tests" / "doc_blocks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs = _load_doc_blocks()


def _host() -> PluginHost:
    host = PluginHost(autoload=False)
    host.add(fb, "fake")
    return host


# ------------------------------------------------------------- docs/writing-a-backend.md


def test_the_registration_check_prints_what_the_guide_shows(monkeypatch) -> None:
    """``python -m hp_cp_core`` with the guide's two backends installed prints the table the
    guide shows (other installed backends left out), and ``--json`` prints JSON."""
    import hp_cp_core.__main__ as cli

    text = docs.block("backend-registration-check")
    commands = re.split(r"^\$ ", text, flags=re.M)[1:]
    assert [c.splitlines()[0] for c in commands] == [
        "python -m hp_cp_core",
        "python -m hp_cp_core --json",
    ]
    shown = commands[0].splitlines()[1:]

    class GuideHost(PluginHost):
        def report(self):
            return [r for r in super().report() if r["name"] in ("fake", "legacy")]

    for switch in ("HP_CP_PLUGINS", "HP_CP_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(switch, raising=False)
    monkeypatch.setattr(cli, "PluginHost", GuideHost)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([]) == 0
    assert out.getvalue().splitlines() == shown
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--json"]) == 0
    assert {r["name"] for r in json.loads(out.getvalue())["backends"]} == {"fake", "legacy"}


def test_the_backend_api_hook_declares_the_current_api() -> None:
    from hp_cp_core import BACKEND_API, hookimpl

    ns = docs.run("backend-api-hook", {"hookimpl": hookimpl})
    assert ns["hp_cp_backend_api"]() == BACKEND_API


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("fake-backend-hooks", "tests/fakes/hp_cp_fake/fake_backend.py"),
        ("fake-backend-attention", "tests/fakes/hp_cp_fake/fake_backend.py"),
    ],
)
def test_excerpts_are_the_files_lines(name: str, source: str) -> None:
    """An excerpt (parts between ``...`` lines) is the file's own lines, in order."""
    assert docs.excerpt_problems(docs.block(name), ROOT / source) == []


def test_the_jax_excerpt_is_the_jax_backends_lines() -> None:
    """The block shows two files, each part after its caption comment."""
    text = docs.block("jax-params-excerpt")
    layer, plugin = re.split(r"^# its compress hooks? .*$", text, flags=re.M)
    jax = ROOT / "examples" / "hp-cp-jax" / "src" / "hp_cp_jax"
    layer = re.sub(r"^# the layer's forward .*$", "", layer, flags=re.M)
    assert docs.excerpt_problems(layer, jax / "layer.py") == []
    assert docs.excerpt_problems(plugin, jax / "plugin.py") == []


def _toy() -> fb.ToyAttention:
    return fb.ToyAttention(16, compress_ratio=4, window_size=5, index_topk=3)


def _toy_cp(cp: int, body) -> list:
    """``body(layer, handle, x_local, rank)`` on ``cp`` thread ranks of the fake backend's
    toy layer (r = 4, with an indexer), and the full input ``x``."""
    x = np.random.default_rng(0).standard_normal((8 * cp, 16))
    world = ThreadWorld(cp, timeout=30)

    def rank_fn(rank: int):
        layer = _toy()
        handle = enable_cp(layer, world.mesh(rank), CPConfig(), plugins=_host())
        try:
            return body(layer, handle, handle.shard(x, 0), rank)
        finally:
            disable_cp(handle)

    return world.run(rank_fn), x


def test_the_layer_forward_fragment_runs_cp() -> None:
    """The installed forward's call, on two thread ranks, equals the layer on one device."""

    def body(layer, handle, x, rank):
        query, key, qr = layer.project(x)
        ns = docs.run(
            "layer-forward-call",
            {"cp_forward": layer.cp_forward, "query": query, "key": key, "x": x, "qr": qr}
            | {"cu_seqlens": None},
        )
        return handle.unshard(ns["out"], 0)

    outs, x = _toy_cp(2, body)
    want = fb.single_device(_toy(), x)
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-10)


def test_the_check_first_fragment_runs_and_raises_on_every_rank() -> None:
    """Checks made before ``cp_forward`` (the fragment's ``my_tensor_checks``): with none
    failing the fragment's forward equals one device; one rank's failure raises the same
    ``HpCpError`` on both ranks."""

    def fragment(bad_rank: int | None):
        def body(layer, handle, x, rank):
            ns = {
                "x": x,
                "cp_forward": layer.cp_forward,
                "n_local": x.shape[0],
                "cu_seqlens": None,
                "my_tensor_checks": lambda x, *_: ["x: not finite"] if rank == bad_rank else [],
                "project": lambda x, positions: layer.project(x),
            }
            try:
                return handle.unshard(docs.run("check-before-cp-forward", ns)["out"], 0)
            except HpCpError as exc:
                return exc

        return body

    outs, x = _toy_cp(2, fragment(None))
    for out in outs:
        np.testing.assert_allclose(out, fb.single_device(_toy(), x), rtol=1e-10)
    outs, _ = _toy_cp(2, fragment(1))
    assert all(isinstance(e, HpCpError) and "x: not finite" in str(e) for e in outs), outs
    assert str(outs[0]) == str(outs[1])


def test_the_migrated_group_is_a_current_group() -> None:
    """The guide's 0.1 -> 0.2 group, over a 0.1 group's methods (the thread group's numpy
    exchanges), passes the core's group check as backend API 0.2 and moves the same rows."""
    from hp_cp_core import LayerSpec
    from hp_cp_core.plan import build_rank_plan
    from hp_cp_core.testing import ThreadGroup
    from hp_cp_core.versions import BACKEND_API, check_group_api

    ns = docs.run("migrated-group")
    world = ThreadWorld(2, timeout=30)
    spec = LayerSpec(compress_ratio=4, window_size=8, has_indexer=True)

    class Migrated(ns["Group"]):
        def __init__(self, mesh):
            self.old = ThreadGroup(mesh)
            self._exchange_rows_0_1 = lambda items: self.old.exchange_rows_np(
                [a for a, _ in items], [p for _, p in items]
            )
            self._all_gather_rows_0_1 = self.old.all_gather_rows_np

        def __getattr__(self, name):  # the rest of the 0.1 group, unchanged
            return getattr(self.old, name)

    def rank_fn(rank: int):
        group = check_group_api(Migrated(world.mesh(rank)), BACKEND_API, "mine", _toy())
        plan = build_rank_plan(
            rank=rank, cp_size=2, spec=spec, layout_kind="contiguous", total_rows=12
        )
        arrays = [np.full((6, 3), float(rank))]
        token = group.begin_order(arrays[0])
        outs, token = group.exchange_rows([(arrays[0], plan.window)], token)
        assert outs[0].shape[0] == 6 + plan.window.n_halo
        gathered, token = group.all_gather_rows(np.full((2, 3), float(rank)), token)
        return group.end_order(gathered, token)

    for out in world.run(rank_fn):
        assert out.tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
