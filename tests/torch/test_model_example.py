"""A model adapter from outside hp_cp_torch (``tests/model_example``): a fused-QKV sparse
attention model whose adapter and kernel are found only through their entry points, under
CP at cp 1, 2, 3 and 4, both layouts, padded and packed, against the same model on one
process (fp32: outputs 1e-5 relative, each parameter's gradient 1e-4 of max(its largest
gradient, 1e-2 of the model's largest)). Its cases run in the torch suites' shared jobs
(``cases.JOINT_SUITES``)."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch
from cases import rel_err, result
from model_example_cases import example_cases, single_process

pytestmark = pytest.mark.slow

SUITE = "model_example_cases:example_suite"
WORLDS = (1, 2, 3, 4)
PARAMS = [pytest.param(w, c, id=c.name) for w in WORLDS for c in example_cases(w)]


@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_example_model_matches_one_process(world, case) -> None:
    per_rank = result(SUITE, world, case.name)
    assert all(r["adapters"] == [case.adapter] for r in per_rank)
    assert all(r["unpinned"] for r in per_rank)  # disable_cp dropped every layer's adapter
    got = next(r for r in per_rank if r["cp_rank"] == 0)
    want = single_process(case)
    assert rel_err(got["out"], want["out"]) <= 1e-5
    assert rel_err(got["gx"], want["gx"]) <= 1e-4
    largest = max(g.abs().max().item() for g in want["grads"].values())
    assert largest > 0
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        scale = max(grad.abs().max().item(), 1e-2 * largest)
        diff = (got["grads"][name] - grad).abs().max().item()
        assert diff <= 1e-4 * scale, (name, diff, scale)


def test_the_suite_covers_the_issue() -> None:
    cases = [c for w in WORLDS for c in example_cases(w)]
    assert {c.cp for c in cases} == {1, 2, 3, 4}
    assert {(c.layout, c.packed) for c in cases if c.cp == 3} == {
        (layout, packed) for layout in ("contiguous", "load_balanced") for packed in (0, 1)
    }


def test_the_example_is_registered_only_by_entry_points() -> None:
    models = {ep.name: ep.value for ep in md.entry_points(group="hp_cp.torch_models")}
    assert models["hp_cp_model_example.model:PooledAttention"] == (
        "hp_cp_model_example.adapter:PooledAttentionAdapter"
    )
    kernels = {ep.name: ep.value for ep in md.entry_points(group="hp_cp.torch_kernels")}
    assert kernels["example_dense"] == "hp_cp_model_example.kernel:DenseMaskKernel"


def test_the_modeling_file_knows_nothing_of_hp_cp() -> None:
    import hp_cp_model_example.model as model

    lines = open(model.__file__).read().splitlines()
    imports = [ln for ln in lines if ln.startswith(("import ", "from "))]
    assert imports and not [ln for ln in imports if "hp_cp" in ln], imports
    assert torch is not None


@pytest.mark.parametrize("world", [1, 2])
def test_the_optional_hooks_run_once_in_the_base(world) -> None:
    """A model's ``check_inputs`` / ``value_checks`` (skipped for the same tensors) and a
    projection's ``local_work`` (``model_example_cases.checked_adapter``): the same output as
    one process, a bad input or a refusal on the last rank only raises the same error on every
    rank, and at cp 1 the value checks run once for the three layers handed the same ``pos``."""
    from model_example_cases import ExampleCase

    per_rank = result(SUITE, world, f"hooks-cp{world}")
    got = next(r for r in per_rank if r["cp_rank"] == 0)
    want = single_process(ExampleCase(world, "contiguous", False))
    assert rel_err(got["out"], want["out"]) <= 1e-5
    for name, words in (("bad_pos", "pos is not the plan's"), ("refusal", "told to refuse")):
        messages = {r["errors"][name] for r in per_rank}
        assert len(messages) == 1, messages  # every rank, the same error
        message = messages.pop()
        assert words in message and "PooledAttention under CP" in message, message
    if world == 1:
        assert got["value_checks_run"] == 1
    else:  # each layer agrees across ranks in the first forward
        assert all(r["value_checks_run"] == 3 for r in per_rank)
