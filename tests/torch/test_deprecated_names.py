"""What hp_cp_torch removed: the names 0.3.0 deprecated are gone in 0.4.0, each import raising an
``ImportError`` that names its replacement (whose behaviour the old name had); the 0.1 flat
module paths (moved in 0.2) are gone, and nothing in this repository names them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hp_cp_core
from hp_cp_core import CPBatch, HpCpError, plan_batch

REPO = Path(__file__).resolve().parents[2]

MOVED_MODULES = {
    "hp_cp_torch.banded": "hp_cp_torch.kernels.banded",
    "hp_cp_torch.efficient": "hp_cp_torch.kernels.efficient",
    "hp_cp_torch.triton_attention": "hp_cp_torch.kernels.triton_attention",
    "hp_cp_torch.triton_kernels": "hp_cp_torch.kernels.triton_kernels",
    "hp_cp_torch.bench_hotpath": "hp_cp_torch.bench.hotpath",
    "hp_cp_torch.bench_kernel": "hp_cp_torch.bench.kernel",
    "hp_cp_torch.bench_memory": "hp_cp_torch.bench.memory",
    "hp_cp_torch.bench_scaling": "hp_cp_torch.bench.scaling",
    "hp_cp_torch.bench_traffic": "hp_cp_torch.bench.traffic",
    "hp_cp_torch.demo": "hp_cp_torch.cli.demo",
    "hp_cp_torch.launch": "hp_cp_torch.cli.launch",
}
"""The 0.1 module paths removed in 0.3.0 (CHANGELOG) -> where their contents live."""


class BatchRecorder:
    """A stand-in for the enable handle: records the one batch path's call and answers it."""

    def __init__(self, active: bool = True) -> None:
        self.calls: list[dict[str, Any]] = []
        self.module = torch.nn.Linear(2, 2)
        self.active = active

    def batch(self, input_ids: Any, **kwargs: Any) -> CPBatch:
        self.calls.append(kwargs)
        cu = kwargs.get("cu_seqlens")
        plan = plan_batch(int(input_ids.shape[1]), 1, "contiguous", cu)
        return CPBatch(
            input_ids=input_ids,
            position_ids=torch.as_tensor(plan.positions)[None],
            labels=torch.as_tensor(plan.shifted_labels(input_ids.numpy())),
            n_tokens=torch.tensor(3),
            cu_seqlens=None if cu is None else torch.as_tensor(plan.cu_seqlens),
            plan=plan,
        )


def _removed(module: str, name: str, replacement: str):
    """``from hp_cp_torch.integrations.<module> import <name>`` raises an ``ImportError`` that
    says it was removed in 0.4.0 and names what replaces it."""
    message = (
        re.escape(f"hp_cp_torch.integrations.{module}.{name} was removed in hp_cp 0.4.0 ")
        + r"\(deprecated since 0\.3\.0\); use "
        + re.escape(replacement)
    )
    with pytest.raises(ImportError, match=message):
        exec(f"from hp_cp_torch.integrations.{module} import {name}", {})
    with pytest.raises(ImportError, match=message):  # an attribute read says the same
        getattr(importlib.import_module(f"hp_cp_torch.integrations.{module}"), name)


IDS = torch.arange(1, 9).reshape(1, 8)


def test_cp_causal_lm_batch_is_removed_for_handle_batch() -> None:
    _removed("transformers", "cp_causal_lm_batch", "handle.batch(input_ids, labels=labels)")
    handle = BatchRecorder()
    got = handle.batch(IDS, labels=None, ignore_index=-7)  # what it called
    assert handle.calls == [{"labels": None, "ignore_index": -7}]
    assert (got.input_ids, got.position_ids, got.labels, got.n_tokens) is not None


def test_cp_dsa_batch_is_removed_for_handle_batch() -> None:
    _removed("transformers_dsa", "cp_dsa_batch", "handle.batch(input_ids, cu_seqlens=cu)")
    handle = BatchRecorder()
    got = handle.batch(IDS, cu_seqlens=[0, 3, 8])
    assert handle.calls[0]["cu_seqlens"] == [0, 3, 8]
    assert got.model_inputs()["hp_cp_cu_seqlens"].tolist() == [0, 3, 8]


def test_nemo_batch_names_are_removed_for_cp_nemo_batch() -> None:
    from hp_cp_torch.integrations.nemo_automodel import cp_nemo_batch

    replacement = "hp_cp_torch.integrations.nemo_automodel.cp_nemo_batch"
    _removed("nemo_automodel", "nemo_cp_batch", replacement)
    _removed("nemo_automodel_v41", "nemo_v41_cp_batch", replacement)
    handle = BatchRecorder()
    got = cp_nemo_batch(handle, IDS, seq_lens=[[3, 5, -1000]])
    assert got["cu_seqlens"].tolist() == [0, 3, 8]
    assert handle.calls[0]["cu_seqlens"].tolist() == [0, 3, 8]
    got = cp_nemo_batch(handle, IDS, ignore_index=-7)
    assert handle.calls[1]["labels"] is IDS  # the inputs, as the one batch path defaults them
    assert (handle.calls[1]["cu_seqlens"], handle.calls[1]["ignore_index"]) == (None, -7)
    assert sorted(got) == ["input_ids", "labels", "n_tokens", "position_ids"]


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("nemo_automodel", "enable_cp"),
        ("nemo_automodel_v41", "enable_cp_v41"),
        ("nemo_automodel_dsa", "enable_cp_dsa"),
        ("veomni", "enable_cp"),
    ],
)
def test_stack_enable_cp_is_removed_naming_the_core_entry_point(module: str, name: str) -> None:
    _removed(module, name, "hp_cp_core.enable_cp(model, mesh, config)")
    with pytest.raises(HpCpError, match="backend accepts a `torch.nn.modules.linear.Linear`"):
        hp_cp_core.enable_cp(torch.nn.Linear(2, 2), None)  # what it fell back to


@pytest.mark.parametrize("module", ["nemo_automodel", "veomni"])
def test_stack_disable_cp_is_removed_naming_the_core_one(module: str) -> None:
    _removed(module, "disable_cp", "hp_cp_core.disable_cp(handle)")
    hp_cp_core.disable_cp(BatchRecorder(active=False))  # the core's: nothing left to undo


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("transformers", "hf_adapter_for"),
        ("nemo_automodel", "nemo_adapter_for"),
        ("veomni", "veomni_adapter_for"),
        ("nemo_automodel_dsa", "nemo_dsa_adapter_for"),
        ("nemo_automodel_dsa", "is_dsa_model"),
    ],
)
def test_the_wrappers_helpers_are_removed_naming_the_registry(module: str, name: str) -> None:
    _removed(module, name, "hp_cp_torch.adapter.adapter_for(module)")
    from hp_cp_torch.adapter import adapter_for

    assert adapter_for(torch.nn.Linear(2, 2)) is None  # what replaces them: no adapter claims it


def test_other_missing_names_stay_attribute_errors() -> None:
    from hp_cp_torch.integrations import veomni

    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        veomni.no_such_name  # noqa: B018
    assert not hasattr(veomni, "no_such_name")


def test_transformers_demo_path_is_removed_for_cli_parity() -> None:
    from hp_cp_torch.cli import parity

    sys.modules.pop("hp_cp_torch.integrations.transformers_demo", None)
    with pytest.raises(ModuleNotFoundError, match="transformers_demo"):
        importlib.import_module("hp_cp_torch.integrations.transformers_demo")
    assert parity.TINY_CONFIG is not None and callable(parity.build_tiny_model)


def test_renamed_names_are_plain_aliases() -> None:
    from hp_cp_torch.integrations import veomni

    assert veomni.VeOmniBatch is hp_cp_core.CPBatch
    assert hp_cp_core.DeepSeekV4CPConfig is hp_cp_core.CPConfig
    assert hp_cp_core.DeepSeekV4CPContext is hp_cp_core.CPContext
    assert hp_cp_core.DeepSeekV4CPForward is hp_cp_core.CPForward


# ------------------------------------------------------------------- the 0.1 paths are gone


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_old_module_path_is_removed(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert importlib.util.find_spec(MOVED_MODULES[old]) is not None


def test_the_packages_have_no_0_1_names() -> None:
    import hp_cp_torch.bench
    import hp_cp_torch.cli

    for package, name in [(hp_cp_torch.bench, "run"), (hp_cp_torch.cli, "main")]:
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(package, name)
    from hp_cp_torch.bench import kernel  # a submodule stays the submodule

    assert kernel.__name__ == "hp_cp_torch.bench.kernel"


def test_python_m_bench_runs_the_bench_command() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-m", "hp_cp_torch.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout


# ----------------------------------------------------------------- nothing here uses them

OLD_LEAVES = {old.rpartition(".")[2] for old in MOVED_MODULES}
OLD_PACKAGE_MODULES = {"hp_cp_torch.bench", "hp_cp_torch.cli"}  # 0.1 modules, packages now
SKIP_DIRS = {".git", ".nox", "site", "build", "dist", "node_modules"}
OLD_TEXT = re.compile(
    rf"hp_cp_torch[./](?:{'|'.join(sorted(OLD_LEAVES))})\b(?!/)"
    r"|hp_cp_torch/(?:bench|cli)\.py|hp_cp_torch\.cli:main"
)


def _repo_files(suffixes: tuple[str, ...]) -> list[Path]:
    return [
        p
        for p in REPO.rglob("*")
        if p.suffix in suffixes
        and p.is_file()
        and not SKIP_DIRS & set(p.relative_to(REPO).parts)
        and not any(part.startswith(".venv") for part in p.relative_to(REPO).parts)
    ]


def old_path_imports(tree: ast.AST) -> list[str]:
    """The imports in ``tree`` that name a 0.1 module path."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in MOVED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in MOVED_MODULES:
                found.append(node.module)
            elif node.module == "hp_cp_torch":
                found += [f"hp_cp_torch.{a.name}" for a in node.names if a.name in OLD_LEAVES]
            elif node.module in OLD_PACKAGE_MODULES:
                found += [
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if importlib.util.find_spec(f"{node.module}.{a.name}") is None
                ]
    return found


def test_the_repository_imports_no_old_path() -> None:
    here = Path(__file__).resolve()
    sources = [p for p in _repo_files((".py",)) if p != here]
    assert any(p.name == "test_bench.py" for p in sources)
    uses = {
        str(p.relative_to(REPO)): bad
        for p in sources
        if (bad := old_path_imports(ast.parse(p.read_text(), str(p))))
    }
    assert uses == {}


def test_the_docs_and_configs_name_no_old_path() -> None:
    here = Path(__file__).resolve()
    texts = [p for p in _repo_files((".md", ".toml", ".yml", ".sh", ".py", ".cfg", ".ini"))]
    skip = {REPO / "CHANGELOG.md", here}
    uses = {
        str(p.relative_to(REPO)): OLD_TEXT.findall(p.read_text())
        for p in texts
        if p not in skip and OLD_TEXT.search(p.read_text())
    }
    assert uses == {}


def test_the_old_path_finders_see_old_paths() -> None:
    tree = ast.parse(
        "from hp_cp_torch import banded\nimport hp_cp_torch.launch\n"
        "from hp_cp_torch.bench import main, kernel\nfrom hp_cp_torch.cli import commands\n"
    )
    assert old_path_imports(tree) == [
        "hp_cp_torch.banded",
        "hp_cp_torch.launch",
        "hp_cp_torch.bench.main",
    ]
    assert OLD_TEXT.findall("`hp_cp_torch/bench_traffic.py`, python -m hp_cp_torch.demo") == [
        "hp_cp_torch/bench_traffic",
        "hp_cp_torch.demo",
    ]
    assert not OLD_TEXT.search("hp_cp_torch.cli.demo hp_cp_torch/kernels/banded.py")
