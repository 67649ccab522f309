"""``import hp_cp_core``, plugin discovery and a full CP forward on the fake backend never import
a deep-learning framework (checked in a fresh interpreter, as array-api-compat does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

FRAMEWORKS = ("torch", "mindspore")

SCRIPT = textwrap.dedent(
    """
    import json, sys

    def frameworks():
        return sorted(m for m in sys.modules if m.split(".")[0] in {frameworks!r})

    report = {{}}
    import hp_cp_core
    report["import hp_cp_core"] = frameworks()

    import numpy as np
    from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
    from hp_cp_core.plugins import PluginHost
    from hp_cp_fake import fake_backend as fb

    host = PluginHost(autoload=False)
    host.add(fb, "fake")
    x = np.random.default_rng(0).normal(size=(48, 6))
    cu = np.array([0, 3, 30, 48])
    world = fb.FakeWorld(3)

    def rank_fn(rank):
        layer = fb.ToyAttention(compress_ratio=4, window_size=7)
        handle = enable_cp(layer, fb.FakeMesh(world, rank),
                           DeepSeekV4CPConfig(layout="load_balanced"), plugins=host)
        out = handle.unshard(layer(handle.shard(x, 0), cu_seqlens=cu), 0)
        disable_cp(handle)
        return out

    ref = fb.single_device(fb.ToyAttention(compress_ratio=4, window_size=7), x, cu)
    assert all(np.allclose(out, ref) for out in world.run(rank_fn))
    report["fake CP forward"] = frameworks()

    # discovery through the installed entry points: the fake only, or every plugin
    import importlib.metadata as md
    eps = md.entry_points(group="hp_cp")
    if sys.argv[1] == "fake":
        eps = [ep for ep in eps if ep.name == "fake"]
    host = PluginHost(autoload=False, entry_points=eps)
    report["discovery " + ",".join(sorted(host.statuses))] = frameworks()
    print(json.dumps(report))
    """
).format(frameworks=set(FRAMEWORKS))


def run_script(discover: str) -> dict[str, list[str]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HP_CP_")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, discover],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_core_and_fake_forward_import_no_framework() -> None:
    report = run_script("fake")
    assert report == {
        "import hp_cp_core": [],
        "fake CP forward": [],
        "discovery fake": [],
    }


def test_discovering_every_installed_plugin_imports_no_framework() -> None:
    """A backend's ``_plugin`` module (and its package ``__init__``) must not import its
    framework at module level: discovery runs in every process that imports hp_cp_core."""
    report = run_script("all")
    assert all(mods == [] for mods in report.values()), report
