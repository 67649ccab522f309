"""The model-adapter contract, declared (hp_cp_torch 0.4): the spec
(:class:`hp_cp_torch.model.spec.ModelAdapter`) has only model-math hooks, each documented
once with when it is called and its default; the guide's tables are generated from those
docstrings; no shipped model adapter overrides anything but a spec hook; the machinery cannot
be overridden; an adapter written against 0.3.0 warns, naming each new hook.

``python tests/torch/test_model_spec.py`` rewrites the guide's generated tables.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as md
import inspect
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from hp_cp_core import HpCpError
from hp_cp_torch.model.spec import (
    MACHINERY,
    RENAMED_0_3,
    REQUIRED,
    ModelAdapter,
    ModelHandle,
    PlanView,
    Traits,
)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-model-adapter.md"

SPEC = (
    "claims traits prepare_model layer_spec layer_name read_inputs check_inputs value_checks "
    "project compress compress_index_keys index_queries index_scores indexer_loss_scores "
    "indexer_row_kl block_candidates indexer_params attention_params attention output finish"
).split()
"""The spec's public names, in the order the guide's table lists them."""


def spec_names() -> list[str]:
    """The public names of :class:`ModelAdapter`, in definition order."""
    return [n for n in vars(ModelAdapter) if not n.startswith("_")]


def _md(text: str) -> str:
    """reST roles and double backticks as Markdown, on one line."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return " ".join(text.replace("``", "`").split())


def _sections(doc: str) -> dict[str, str]:
    """The docstring's first paragraph (``""``) and its ``Called:`` / ``Default:`` lines."""
    paragraphs = doc.split("\n\n")
    out, key = {"": paragraphs[0]}, None
    for line in "\n".join(paragraphs[1:]).splitlines():
        match = re.match(r"(Called|Default):\s*(.*)", line.strip())
        if match:
            key = match.group(1)
            out[key] = match.group(2)
        elif key is not None and line.strip() and not line.strip().endswith(":"):
            out[key] += " " + line.strip()
        else:
            key = None
    return out


def _attributes(doc: str) -> dict[str, str]:
    """A Google-style ``Attributes:`` section: name -> its text."""
    section = doc.split("Attributes:\n", 1)[1].split("\n\n", 1)[0]
    out: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        match = re.match(r"\s{4}(\w+): (.*)", line)
        if match:
            name = match.group(1)
            out[name] = match.group(2)
        elif name is not None:
            out[name] += " " + line.strip()
    return out


def hook_table() -> list[str]:
    """The guide's table of the spec, one row per public name, from the docstrings."""
    rows = [
        "| hook | what the model returns | called | default | required for |",
        "|---|---|---|---|---|",
    ]
    attributes = _attributes(inspect.getdoc(ModelAdapter))
    for name in spec_names():
        value = inspect.getattr_static(ModelAdapter, name)
        if name in attributes:
            shown = "Traits()" if isinstance(value, Traits) else repr(value)
            rows.append(f"| `{name}` | {_md(attributes[name])} | class attribute | `{shown}` | |")
            continue
        fn = value.__func__ if isinstance(value, classmethod) else value
        params = list(inspect.signature(fn).parameters)[1:]
        doc = _sections(inspect.getdoc(fn))
        cells = [_md(doc[""]), _md(doc["Called"]), _md(doc["Default"])]
        cells.append(REQUIRED[name].text if name in REQUIRED else "")
        rows.append(f"| `{name}({', '.join(params)})` | " + " | ".join(cells) + " |")
    return rows


def traits_table() -> list[str]:
    """The guide's table of :class:`Traits`, from its docstring."""
    rows = ["| trait | meaning | default |", "|---|---|---|"]
    defaults = Traits()
    for name, text in _attributes(inspect.getdoc(Traits)).items():
        value = getattr(defaults, name)
        shown = value.__name__ if isinstance(value, type) else repr(value)
        rows.append(f"| `{name}` | {_md(text)} | `{shown}` |")
    return rows


def views_table() -> list[str]:
    """The guide's table of what a model file reads besides the hooks' arguments: its layer
    (``ModelAdapter.module``), the plan's view (``state.view``, :class:`PlanView`) and the
    handle's (``prepare_model``'s ``handle``, :class:`ModelHandle`), from their docstrings."""
    rows = ["| read as | what it is |", "|---|---|"]
    module = _attributes(inspect.getdoc(ModelAdapter))["module"]
    rows.append(f"| `self.module` | {_md(module)} |")
    for prefix, cls in (("state.view", PlanView), ("handle", ModelHandle)):
        for name, text in _attributes(inspect.getdoc(cls)).items():
            rows.append(f"| `{prefix}.{name}` | {_md(text)} |")
    return rows


TABLES = {"spec table": hook_table, "traits table": traits_table, "views table": views_table}


def guide_table(text: str, name: str) -> list[str]:
    """The lines of the guide between ``<!-- name ... -->`` and ``<!-- /name -->``."""
    match = re.search(rf"<!-- {name}[^>]*-->\n(.*?)<!-- /{name} -->", text, re.S)
    assert match, f"{GUIDE.name} has no generated {name}"
    return match.group(1).splitlines()


def write_guide() -> None:
    """Rewrite the guide's generated tables from the spec."""
    text = GUIDE.read_text()
    for name, make in TABLES.items():
        table = "\n".join(make()) + "\n"
        text = re.sub(
            rf"(<!-- {name}[^>]*-->\n).*?(<!-- /{name} -->)",
            lambda m, table=table: m.group(1) + table + m.group(2),
            text,
            flags=re.S,
        )
    GUIDE.write_text(text)


# ------------------------------------------------------------------------------ the spec


def test_the_spec_is_at_most_21_model_math_names() -> None:
    # 21 since 0.5.0: indexer_row_kl, the model's own indexer loss (issue 57, item 4)
    assert spec_names() == SPEC
    assert len(SPEC) <= 21


def test_every_hook_says_when_it_is_called_and_its_default() -> None:
    for name in SPEC:
        value = inspect.getattr_static(ModelAdapter, name)
        if name in ("claims", "traits"):
            continue
        fn = value.__func__ if isinstance(value, classmethod) else value
        doc = _sections(inspect.getdoc(fn))
        assert doc.get("Called") and doc.get("Default"), name


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_guide_tables_are_generated_from_the_spec(name: str) -> None:
    """Run ``python tests/torch/test_model_spec.py`` after changing a hook's docstring."""
    assert guide_table(GUIDE.read_text(), name) == TABLES[name]()


@pytest.mark.parametrize("cls", [PlanView, ModelHandle])
def test_every_field_of_a_view_is_documented(cls: type) -> None:
    fields = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    assert list(_attributes(inspect.getdoc(cls))) == fields


def test_module_is_declared_on_the_spec() -> None:
    assert "module" in ModelAdapter.__annotations__
    assert "module" in _attributes(inspect.getdoc(ModelAdapter))
    assert "module" not in spec_names()  # an attribute every adapter has, not a hook


def test_the_machinery_cannot_be_overridden() -> None:
    for name in ("selection", "begin", "compress_main", "make_forward", "run_attention"):
        with pytest.raises(HpCpError, match=f"defines \\['{name}'\\]: hp_cp's machinery"):
            type("Adapter", (ModelAdapter,), {name: lambda self: None})


def test_a_missing_required_hook_names_itself() -> None:
    class Empty(ModelAdapter, abstract=True):  # checked in its subclasses
        pass

    with pytest.raises(HpCpError, match=r"does not define the hook project\(state\)"):
        Empty(object()).project(None)


def test_a_wrong_index_queries_layout_names_the_hook_and_the_shape() -> None:
    """The default student reads ``state.index_queries`` as DeepSeek's pair; another layout
    is an ``HpCpError`` naming the hook and the shapes, not an einsum error."""
    import torch

    from hp_cp_torch.model.spec import ForwardState, LayerInputs

    adapter = ModelAdapter(torch.nn.Linear(2, 2))
    queries = (torch.zeros(2, 5, 16, 3), torch.zeros(2, 5))  # [B, L, D_I, h]: transposed
    state = ForwardState(LayerInputs(None), torch.zeros(2, 5, 8), torch.zeros(2, 5))
    state.index_queries = queries
    message = (
        r"Linear under CP: the default indexer_loss_scores reads index_queries\(state\) as "
        r"\(queries \[B, L, h, D_I\], weights \[B, L, h\]\) = \(\[2, 5, h, 16\], "
        r"\[2, 5, h\]\); got \[\[2, 5, 16, 3\], \[2, 5\]\]"
    )
    with pytest.raises(HpCpError, match=message):
        adapter.indexer_loss_scores(state, torch.zeros(2, 7, 16), torch.zeros(2, 5, 2).long())
    state.index_queries = (torch.zeros(2, 5, 3, 16), torch.ones(2, 5, 3))  # the right one
    scores = adapter.indexer_loss_scores(state, torch.zeros(2, 7, 16), torch.zeros(2, 5, 2).long())
    assert tuple(scores.shape) == (2, 5, 2)


def test_a_hook_returning_a_wrong_shape_names_the_hook_and_the_shape() -> None:
    import torch

    from hp_cp_torch.model.runner import LayerRunner

    runner = LayerRunner(ModelAdapter(torch.nn.Linear(2, 2)))
    message = (
        r"Linear under CP: the hook compress\(rows, start, state\) returned \[2, 3\]; "
        r"expected \[B, n // r, D\] = \[2, 1, \*\]"
    )
    with pytest.raises(HpCpError, match=message):
        runner.expect(
            "compress(rows, start, state)", torch.zeros(2, 3), (2, 1, None), "[B, n // r, D]"
        )
    runner.expect(
        "compress(rows, start, state)", torch.zeros(2, 1, 4), (2, 1, None), "[B, n // r, D]"
    )


# ------------------------------------------------ the hooks checked when a model is defined


def _layer_hooks() -> dict[str, object]:
    """The hooks every layer needs, as a class body would define them."""
    return {
        "layer_spec": lambda self: None,
        "project": lambda self, state: None,
        "attention_params": lambda self: None,
        "output": lambda self, o, state: None,
    }


def _compress(self: ModelAdapter, rows: object, start: int, state: object) -> None:
    """A hook of the 0.4 signature for ``compress`` / ``compress_index_keys``."""


def test_a_misspelled_hook_is_refused_when_the_class_is_defined() -> None:
    message = (
        r"Misspelled defines 'index_score', which is no hook of hp_cp_torch.ModelAdapter. "
        r"Did you mean index_scores\(state, lo, hi, keys\)\? A helper of the model's own is "
        r"private: _index_score"
    )
    with pytest.raises(HpCpError, match=message):

        class Misspelled(ModelAdapter):
            def layer_spec(self):  # noqa: ANN201
                return None

            def project(self, state):  # noqa: ANN001, ANN201
                return None

            def attention_params(self):  # noqa: ANN201
                return None

            def output(self, o, state):  # noqa: ANN001, ANN201
                return None

            def index_score(self, state, lo, hi, keys):  # noqa: ANN001, ANN201
                return None

    with pytest.raises(HpCpError, match=r"'compres'.*Did you mean compress\(rows, start, state\)"):
        type("Adapter", (ModelAdapter,), {**_layer_hooks(), "compres": None})
    with pytest.raises(HpCpError, match=r"'trait'.*Did you mean traits\?"):
        type("Adapter", (ModelAdapter,), {**_layer_hooks(), "trait": Traits()})


def test_a_runner_step_is_refused_when_the_class_is_defined() -> None:
    for name, near in [("indexer_loss", "indexer_loss_scores"), ("expect", None)]:
        message = f"defines \\['{name}'\\]: hp_cp's machinery"
        with pytest.raises(HpCpError, match=message) as err:
            type("Adapter", (ModelAdapter,), {**_layer_hooks(), name: lambda self: None})
        if near is not None:
            assert f"{name}: Did you mean {near}(" in str(err.value)


def test_the_machinery_names_are_the_runners_steps() -> None:
    """:data:`MACHINERY` is every public method of the runner that is no spec hook."""
    from hp_cp_torch.model.runner import LayerRunner

    steps = {n for n, v in vars(LayerRunner).items() if not n.startswith("_") and callable(v)}
    assert steps - set(SPEC) <= set(MACHINERY)
    assert not set(MACHINERY) & set(SPEC)


def test_a_missing_required_hook_is_refused_when_the_class_is_defined() -> None:
    hooks = _layer_hooks()
    del hooks["output"], hooks["attention_params"]
    message = (
        r"NoOutput does not define the hooks \['attention_params\(\)', 'output\(o, state\)'\] "
        r"that every layer needs .* class NoOutput\(ModelAdapter, abstract=True\)"
    )
    with pytest.raises(HpCpError, match=message):
        type("NoOutput", (ModelAdapter,), hooks)
    base = type("Base", (ModelAdapter,), hooks, abstract=True)  # its subclasses fill them
    type("Layer", (base,), {"output": hooks["project"], "attention_params": hooks["project"]})
    with pytest.raises(
        HpCpError, match=r"Child does not define the hooks \['output\(o, state\)'\]"
    ):
        type("Child", (base,), {"attention_params": hooks["project"]})


@pytest.mark.parametrize(
    ("spec", "kind", "missing"),
    [
        ({"compress_ratio": 0}, "shared_kv", []),
        ({"compress_ratio": 128}, "shared_kv", ["compress"]),
        (
            {"compress_ratio": 4, "has_indexer": True},
            "shared_kv",
            ["compress", "compress_index_keys", "index_scores"],
        ),
        (
            {"compress_ratio": 4, "has_indexer": True},
            "own",
            ["compress", "compress_index_keys", "attention"],
        ),
        (
            {"compress_ratio": 1, "has_indexer": True, "reuses": ("selection",)},
            "shared_kv",
            ["compress"],
        ),
    ],
)
def test_the_hooks_a_layer_needs_are_checked_at_install(
    spec: dict[str, object], kind: str, missing: list[str]
) -> None:
    """What the layer does (its ``LayerSpec``, its attention's kind) decides the rest of
    :data:`REQUIRED`; ``enable_cp`` checks it before installing (``prepare_module``)."""
    from hp_cp_core import LayerSpec
    from hp_cp_torch.model.spec import AttentionParams, check_layer_hooks

    hooks = _layer_hooks() | {
        "layer_spec": lambda self: LayerSpec(**spec),
        "attention_params": lambda self: AttentionParams(1.0, kind=kind),
    }
    adapter = type("Partial", (ModelAdapter,), hooks)(torch.nn.Linear(2, 2))
    if not missing:
        check_layer_hooks(adapter)
        return
    with pytest.raises(HpCpError) as err:
        check_layer_hooks(adapter)
    text = str(err.value)
    assert text.startswith("Linear under CP: Partial does not define the hooks")
    named = re.findall(r"(?:: |; )(\w+)\(", text)
    assert named == missing
    filled = type("Filled", (type(adapter),), {n: _compress for n in missing})
    check_layer_hooks(filled(torch.nn.Linear(2, 2)))


def test_a_helper_is_private_or_refused() -> None:
    hooks = _layer_hooks()
    with pytest.raises(HpCpError, match=r"'rope', which is no hook .*\. A helper of the .* _rope"):
        type("Adapter", (ModelAdapter,), {**hooks, "rope": lambda self: None})
    type("Adapter", (ModelAdapter,), {**hooks, "_rope": lambda self: None, "__doc__": "ok"})

    class Mixin:  # no adapter: its public names land in the hooks' namespace
        def rope(self) -> None: ...

    with pytest.raises(HpCpError, match=r"defines 'rope' \(from .*Mixin\), which is no hook"):
        type("Adapter", (Mixin, ModelAdapter), hooks)


def test_rows_are_slots_refuses_what_it_never_uses() -> None:
    """With ``rows_are_slots`` there is no compressor: its hooks and another
    ``indexer_grad`` than the default would be ignored, so they are refused."""
    hooks = _layer_hooks()
    slots = Traits(rows_are_slots=True)
    type("Adapter", (ModelAdapter,), {**hooks, "traits": slots})
    type(
        "Adapter",
        (ModelAdapter,),
        {**hooks, "traits": Traits(rows_are_slots=True, indexer_grad="loss")},
    )
    for extra in [
        {"compress": _compress},
        {"compress_index_keys": _compress},
        {"traits": Traits(rows_are_slots=True, indexer_grad="none")},
    ]:
        with pytest.raises(HpCpError, match="declares traits.rows_are_slots=True but also"):
            type("Adapter", (ModelAdapter,), {**hooks, "traits": slots, **extra})


# ------------------------------------------------------------------ the shipped models


def shipped_adapters() -> list[type]:
    """Every model adapter class hp_cp_torch ships: its entry points, and the function
    adapter."""
    from hp_cp_torch.adapter import TorchDeepSeekV4CSAAdapter

    found = {TorchDeepSeekV4CSAAdapter}
    for ep in md.entry_points(group="hp_cp.torch_models"):
        if ep.value.startswith("hp_cp_torch."):
            found.add(ep.load())
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


def overrides(cls: type) -> dict[str, list[str]]:
    """Per class between ``cls`` and :class:`ModelAdapter`: the names it defines that a base
    class defines too (its overrides), dunder methods left out."""
    chain = cls.__mro__[: cls.__mro__.index(ModelAdapter)]
    out = {}
    for i, klass in enumerate(chain):
        later = [vars(base) for base in cls.__mro__[i + 1 :]]
        names = [
            n
            for n in vars(klass)
            if not (n.startswith("__") and n.endswith("__")) and any(n in v for v in later)
        ]
        if names:
            out[klass.__qualname__] = names
    return out


def test_the_shipped_models_override_only_spec_hooks() -> None:
    adapters = shipped_adapters()
    assert len(adapters) == 10  # 9 by entry point (V3.2 and GLM-5 share one), the function one
    report = {cls.__qualname__: overrides(cls) for cls in adapters}
    stray = {
        name: {klass: [n for n in names if n not in SPEC] for klass, names in found.items()}
        for name, found in report.items()
    }
    assert {n: s for n, s in stray.items() if any(s.values())} == {}
    # what each overrides (a model file's whole surface: the spec's hooks)
    assert set(report["DeepseekV4AttentionAdapter"]["DeepseekV4AttentionAdapter"]) >= {
        "layer_spec",
        "compress",
        "attention",
        "traits",
    }
    assert (
        "block_candidates"
        in report["NemoDeepseekV41AttentionAdapter"]["NemoDeepseekV41AttentionAdapter"]
    )


MODEL_FILES = {
    "adapter.py": {
        "ReferenceLayerAdapter": "layer_spec read_inputs project compress compress_index_keys "
        "index_queries index_scores indexer_params attention_params output",
        "TorchDeepSeekV4CSAAdapter": "traits layer_spec layer_name read_inputs check_inputs "
        "project compress compress_index_keys attention_params attention output",
    },
    "integrations/megatron.py": {
        "MegatronDSAAttentionAdapter": "claims traits prepare_model layer_spec layer_name "
        "read_inputs check_inputs value_checks project index_scores indexer_row_kl "
        "indexer_params attention_params attention output finish",
    },
    "integrations/nemo_automodel.py": {
        "NemoDeepseekV4AttentionAdapter": "prepare_model layer_spec read_inputs check_inputs "
        "project compress compress_index_keys index_queries index_scores indexer_params output",
    },
    "integrations/nemo_automodel_dsa.py": {
        "NemoDeepseekV32Refusal": "",
        "NemoGlmDsaAttentionAdapter": "traits prepare_model layer_name read_inputs check_inputs "
        "value_checks project index_scores attention_params attention finish",
    },
    "integrations/nemo_automodel_v41.py": {
        "NemoDeepseekV41AttentionAdapter": "traits prepare_model layer_spec read_inputs "
        "check_inputs value_checks project compress compress_index_keys index_queries "
        "index_scores block_candidates indexer_params attention_params output finish",
    },
    "integrations/transformers.py": {
        "TransformersAttention": "prepare_model check_inputs value_checks",
        "DeepseekV4AttentionAdapter": "traits layer_spec read_inputs project compress "
        "compress_index_keys index_queries index_scores indexer_params attention_params "
        "attention output finish",
    },
    "integrations/transformers_dsa.py": {
        "DSAAttentionAdapter": "traits layer_spec read_inputs project index_scores "
        "indexer_params attention_params attention output finish",
    },
    "integrations/veomni.py": {
        "VeOmniDeepseekV4AttentionAdapter": "traits prepare_model check_inputs index_scores",
    },
}
"""Each shipped model file -> its adapter classes -> the hooks each fills (its public names:
nothing else, Note [Hooks checked when a model is defined]), in the spec's order."""


def test_each_shipped_model_file_fills_these_hooks_and_nothing_else() -> None:
    import hp_cp_torch

    root = Path(hp_cp_torch.__file__).parent
    found: dict[str, dict[str, str]] = {}
    for path in MODEL_FILES:
        name = "hp_cp_torch." + path.removesuffix(".py").replace("/", ".")
        module = importlib.import_module(name)
        assert (root / path).is_file()
        for attr, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, ModelAdapter):
                if value.__module__ != name and not attr.endswith("Refusal"):
                    continue  # imported from elsewhere
                filled = [n for n in vars(value) if not n.startswith("_")]
                assert set(filled) <= set(SPEC), (attr, filled)
                found.setdefault(path, {})[attr] = " ".join(n for n in SPEC if n in filled)
    assert found == MODEL_FILES
    shipped = {cls.__qualname__ for cls in shipped_adapters()} - {"refuse.<locals>.Refusal"}
    assert shipped <= {c for classes in MODEL_FILES.values() for c in classes}


def test_overrides_are_found() -> None:
    class Base(ModelAdapter, abstract=True):
        def _helper(self) -> None: ...

    class Child(Base, abstract=True):
        def _helper(self) -> None: ...

        def project(self, state):  # noqa: ANN001, ANN201
            return None

    assert overrides(Child) == {"test_overrides_are_found.<locals>.Child": ["_helper", "project"]}


# ------------------------------------------------------------------ 0.3.0 adapters


def _fresh_import(name: str) -> list[str]:
    """Import ``name`` anew; the deprecation warnings its class definitions raise."""
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(name)
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_the_0_3_example_warns_naming_each_new_hook() -> None:
    """The guide's 0.3.0 example adapter, unchanged: one warning per 0.3 name, each naming
    the hook that replaces it (it runs under CP as before: ``test_model_example.py``)."""
    got = _fresh_import("hp_cp_model_example.adapter_v03")
    old = ["packed_topk_row", "hidden_size", "compress", "compress_index_keys", "index_topk"]
    old += ["sink", "scale"]
    assert len(got) == len(old), got
    for name in old:
        start = f"PooledAttentionAdapter.{name} is the hp_cp 0.3 model-adapter API"
        message = next(m for m in got if start in m)
        assert "deprecated since 0.4.0" in message
        assert f"use {RENAMED_0_3[name]} instead" in message, message


def test_a_0_3_third_party_adapter_warns_naming_each_new_hook() -> None:
    """A third party's 0.3 adapter with ``compress(rows, start, state)`` (already the 0.4
    signature: no warning for it) and its own ``index_scores_at`` (it trains the reference
    layer's indexer under CP as before: ``test_indexer_loss.py``)."""
    got = " ".join(_fresh_import("v03_adapters"))
    for name in ("index_scores_at", "index_topk", "index_heads", "indexer_loss_coeff"):
        assert f"ThirdPartyAdapter.{name} is the hp_cp 0.3" in got
    assert "use indexer_loss_scores(state, keys, selected) instead" in got
    assert "ThirdPartyAdapter.compress is" not in got


def test_0_3_class_attributes_become_traits() -> None:
    from hp_cp_torch.model.spec import ForwardState

    class State(ForwardState):
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Old(ModelAdapter, abstract=True):  # its 0.3 names only
            state_class = State
            sequence_dim = 0
            packed_topk_row = "stream"
            index_keys_without_grad = True

        class Full(ModelAdapter, abstract=True):
            detach_indexer_inputs = False

    assert Old.traits == Traits(State, 0, "stream", indexer_grad="none")
    assert Full.traits == Traits(indexer_grad="full")
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 5


def test_a_0_3_adapter_runs_its_0_3_methods_as_the_new_hooks() -> None:
    import v03_adapters

    from hp_cp_torch.model.spec import AttentionParams, IndexerParams

    cls = v03_adapters.ThirdPartyAdapter
    assert cls.traits.indexer_grad == "loss"

    class Layer:
        class config:  # noqa: N801
            index_topk, indexer_loss_coeff = 3, 0.5

        indexer = type("Indexer", (), {"n_heads": 2})()
        softmax_scale, attn_sink = 0.25, "sink"
        computes_indexer_loss = True

    adapter = cls(Layer())
    assert adapter.indexer_params() == IndexerParams(3, 2, 0.5)
    assert adapter.attention_params() == AttentionParams(0.25, "sink")
    adapter.index_scores_at = lambda state, keys, selected: (state, keys, selected)
    assert adapter.indexer_loss_scores(1, 2, 3) == (1, 2, 3)


if __name__ == "__main__":
    write_guide()
