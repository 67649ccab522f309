"""The framework-free blocks of docs/ (``<!-- tested: NAME -->``), run or checked here
(``nox -s core``): the backend guide's hooks and layer-forward fragments on the numpy fake
backend and thread ranks, the testing kit's examples, the excerpts of shipped files against
those files, the diagrams' and the listing's names against the code and the tree, printed
output against the code that prints it. The torch pages' blocks run in
``tests/torch/test_doc_blocks.py``."""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tomllib

from hp_cp_core import CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_core.plugins import PluginHost
from hp_cp_core.testing import ThreadWorld
from hp_cp_fake import fake_backend as fb

ROOT = Path(__file__).resolve().parents[2]


docs = SimpleNamespace(**runpy.run_path(str(ROOT / "tests" / "doc_blocks.py")))


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


def test_the_group_order_diagram_names_the_group_protocol() -> None:
    """The backward-order diagram's steps are the ``Group`` protocol's methods and its
    ``point_to_point`` switch."""
    from hp_cp_core.backend import Group

    text = docs.block("group-order-diagram")
    steps = set(re.findall(r"--(\w+)-->", text)) | set(re.findall(r"\b(all_gather_rows)\b", text))
    assert steps == {"begin_order", "exchange_rows", "end_order", "all_gather_rows"}
    assert all(callable(getattr(Group, s, None)) for s in steps)
    assert "point_to_point" in text and "point_to_point" in (Group.__doc__ or "")


# ------------------------------------------------------------------------ docs/design.md


def test_the_pieces_diagram_names_the_cores_modules() -> None:
    text = docs.block("core-pieces-diagram")
    core = ROOT / "hp_cp_core" / "src" / "hp_cp_core"
    named = re.findall(r"\b(\w+\.py)\b", text)
    assert named and [n for n in named if not (core / n).is_file()] == []
    assert (core / "testing").is_dir()
    for dist in re.findall(r"^(hp-cp-\w+)", text, flags=re.M):
        assert (ROOT / dist.replace("-", "_") / "pyproject.toml").is_file(), dist


def test_the_forward_diagram_calls_the_hooks_with_their_arguments() -> None:
    """Each hook the diagram calls is a hook spec taking those arguments (after ``module``),
    in that order; its order tokens are the ``Group`` protocol's."""
    import inspect

    from hp_cp_core import hookspecs
    from hp_cp_core.backend import Group

    text = docs.block("forward-stages-diagram")
    calls = re.findall(r"\b(hp_cp_\w+)(?:\(([^)]*)\))?", text)
    assert {name for name, _ in calls} == {
        "hp_cp_extract_ori_kv",
        "hp_cp_compress_main",
        "hp_cp_compress_indexer",
        "hp_cp_run_attention",
    }
    for name, args in calls:
        params = list(inspect.signature(getattr(hookspecs, name)).parameters)
        assert params[0] == "module", name
        shown = [a.strip() for a in args.split(",") if a.strip()]
        assert shown == params[1 : 1 + len(shown)], (name, shown, params)
    for method in re.findall(r"\b(begin_order|end_order)\(", text):
        assert callable(getattr(Group, method))


# ------------------------------------------------------------------------- docs/index.md


def _listed(text: str) -> list[str]:
    """The module and folder names of one listing line's names part: ``x.py`` / ``x/``
    tokens, or a comma list after ``:`` (parentheses dropped, ``+`` joining two)."""
    names = re.findall(r"(?<![\w.])(\w+\.py|\w+/)(?=\s|,|$)", text)
    if names:
        return names
    text = re.sub(r"[^,;:()]*:", "", re.sub(r"\([^)]*\)", "", text))  # labels dropped
    return [n.strip() + ".py" for n in re.split(r"[,+;]", text) if n.strip()]


def test_the_package_layout_is_the_tree() -> None:
    """Every module and folder the listing names exists where it says, and a listing without
    ``...`` names every module of its folder."""
    lines = docs.block("package-layout").splitlines()
    problems: list[str] = []
    package: Path | None = None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        head, _, rest = line.strip().partition(" ")
        if indent == 0:
            package = ROOT / head.rstrip("/") / "src" / head.rstrip("/")
            assert package.is_dir(), head
            folder, names = package, re.findall(r"(?<![\w.])(\w+\.py)\b", rest)
            if not names:
                continue
        elif head.endswith("/") and not head.endswith(".py"):
            folder = package / head.rstrip("/")
            names = _listed(rest)
            if head == "hp_cp_core/" or not folder.is_dir():
                problems.append(f"no folder {folder.relative_to(ROOT)}")
                continue
        else:
            folder, names = package, _listed(line)
        assert package is not None
        for name in names:
            if not (folder / name).exists():
                problems.append(f"{line.strip()[:40]!r}: no {(folder / name).relative_to(ROOT)}")
        if folder != package and "..." not in line:
            have = {p.name for p in folder.glob("*.py") if not p.name.startswith("__")}
            missing = have - set(names)
            if missing:
                problems.append(f"{folder.relative_to(ROOT)} not listed: {sorted(missing)}")
    # the top-level folders: every module and subpackage of a package listed line by line
    for dist in ("hp_cp_torch", "hp_cp_mindformers"):
        package = ROOT / dist / "src" / dist
        have = {
            p.name + ("/" if p.is_dir() else "")
            for p in package.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file()) and not p.name.startswith("__")
        }
        text = "\n".join(lines)
        missing = [n for n in sorted(have) if not re.search(rf"(?<![\w.]){re.escape(n)}", text)]
        if missing:
            problems.append(f"{dist} not listed: {missing}")
    assert problems == []


# --------------------------------------------------------------- docs/testing-a-backend.md


def test_the_contract_entry_points_are_the_jax_examples() -> None:
    """The page's entry points, and the driver's in ``hp_cp_core.testing.cases``' docstring,
    are the JAX example's own."""
    import hp_cp_core.testing.cases as cases

    shown = tomllib.loads(docs.block("jax-entry-points"))
    real = tomllib.loads((ROOT / "examples" / "hp-cp-jax" / "pyproject.toml").read_text())
    assert shown["project"]["entry-points"] == real["project"]["entry-points"]
    example = (cases.__doc__ or "").split("::\n", 1)[1].split("\n\n", 2)[0]
    driver = tomllib.loads(re.sub(r"^    ", "", example, flags=re.M))
    assert (
        driver["project"]["entry-points"]["hp_cp.contract"]
        == (real["project"]["entry-points"]["hp_cp.contract"])
    )


def test_the_thread_group_example_runs_on_thread_ranks() -> None:
    """The kit's numpy exchanges, forward and backward, on 3 thread ranks with a layer's
    halo plans: ``<forward(a), g> == <a, backward(g)>``."""
    from hp_cp_core import LayerSpec
    from hp_cp_core.plan import build_rank_plan
    from hp_cp_core.stats import check_stats
    from hp_cp_core.testing import ThreadGroup

    world = ThreadWorld(3, timeout=30)
    spec = LayerSpec(compress_ratio=4, window_size=8, has_indexer=True)

    def rank_fn(rank: int):
        rng = np.random.default_rng(rank)
        plan = build_rank_plan(
            rank=rank, cp_size=3, spec=spec, layout_kind="contiguous", total_rows=18
        )
        plans = [plan.window, plan.x]
        arrays = [rng.standard_normal((6, 4)) for _ in plans]
        douts = [rng.standard_normal((6 + p.n_halo, 4)) for p in plans]
        array = rng.standard_normal((2, 4))
        dgathered = rng.standard_normal((6, 4))
        ns = docs.run(
            "thread-group-exchanges",
            {"ThreadGroup": ThreadGroup, "mesh": world.mesh(rank), "plans": plans}
            | {"arrays": arrays, "douts": douts, "array": array, "dgathered": dgathered},
        )
        lhs = sum(float((o * d).sum()) for o, d in zip(ns["outs"], douts))
        lhs += float((ns["gathered"] * dgathered).sum())
        rhs = sum(float((a * g).sum()) for a, g in zip(arrays, ns["grads"]))
        rhs += float((array * ns["grad"]).sum())
        return lhs, rhs, ns["group"].stats()

    out = world.run(rank_fn)
    assert abs(sum(o[0] for o in out) - sum(o[1] for o in out)) <= 1e-9
    assert all(not check_stats(o[2]) for o in out)


def test_the_cp_equals_one_device_example_passes_for_the_fake_backend() -> None:
    """The page's test, with the fake backend's toy layer as ``my_layer`` (its ``apply``)."""

    class MyLayer(fb.ToyAttention):
        def __init__(self) -> None:
            super().__init__(8, compress_ratio=4, window_size=5, index_topk=3)

        def apply(self, params, x):
            return self(x)

    ns = docs.run("cp-equals-one-device", {"my_layer": MyLayer, "params": None})
    ns["config"] = CPConfig(layout="load_balanced")
    ns["test_cp_equals_one_device"]()
    ns["test_cp_equals_one_device"](cp=1)


# ------------------------------------------------------------------- docs/mindformers.md

STEP = re.compile(r"^step (?P<step>\d+) loss (?P<loss>\d+\.\d{6}) cp (?P<cp>\d+)$")
EQUAL = re.compile(r"^losses equal \S+/one_process\.json at steps \[(?P<steps>[\d, ]+)\]$")


def test_the_msrun_examples_output_is_what_the_recipe_prints() -> None:
    """The printed lines are the recipe's two prints (seconds per step dropped, as the page
    says), for the page's three runs: cp 1 steps 1-3, cp 2 steps 1-2 checked against it,
    cp 4 resumed for step 3, with equal losses at equal steps."""
    source = (ROOT / "examples" / "train_mindformers_cp.py").read_text(encoding="utf-8")
    assert 'f"step {step} loss {losses[step]:.6f} cp {size} (' in source
    assert 'f"losses equal {args.expect} at steps {both}"' in source
    runs: list[tuple[int, dict[int, str], list[int]]] = []
    for line in docs.block("mindformers-recipe-output").splitlines():
        step, equal = STEP.match(line), EQUAL.match(line)
        assert step or equal, line
        if step:
            cp = int(step["cp"])
            if not runs or runs[-1][0] != cp:
                runs.append((cp, {}, []))
            runs[-1][1][int(step["step"])] = step["loss"]
        else:
            runs[-1][2].extend(int(s) for s in equal["steps"].split(","))
    assert [(cp, sorted(losses), checked) for cp, losses, checked in runs] == [
        (1, [1, 2, 3], []),
        (2, [1, 2], [1, 2]),
        (4, [3], [3]),
    ]
    for _, losses, checked in runs[1:]:
        assert all(losses[s] == runs[0][1][s] for s in checked)
