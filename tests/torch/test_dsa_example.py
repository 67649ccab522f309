"""The guide's DSA example (``tests/dsa_example``): a Llama-style decoder converted to
DeepSeek Sparse Attention (grouped-query, 8 query heads over 2 KV heads; no sink; a layer
that reuses the previous layer's picks; a per-call rotary table; the indexer's KL loss),
its adapter found only through its entry point, under CP at cp 1, 2, 3 and 4, both layouts,
padded and packed, with recomputation and a forward in between, against the same model on
one process (fp32: logits 1e-5 relative, each layer's indexer loss 1e-5, each parameter's
gradient 1e-4 of max(its largest gradient, 1e-2 of the model's largest)). Its cases run in
the torch suites' shared jobs (``cases.JOINT_SUITES``)."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch
from cases import rel_err, result
from dsa_example_cases import dsa_example_cases, single_process

pytestmark = pytest.mark.slow

SUITE = "dsa_example_cases:dsa_example_suite"
WORLDS = (1, 2, 3, 4)
PARAMS = [pytest.param(w, c, id=c.name) for w in WORLDS for c in dsa_example_cases(w)]


@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_dsa_example_matches_one_process(world, case) -> None:
    got = next(r for r in result(SUITE, world, case.name) if r["cp_rank"] == 0)
    want = single_process(case)
    assert rel_err(got["out"], want["out"]) <= 1e-5
    assert [x is None for x in got["losses"]] == [x is None for x in want["losses"]]
    assert want["losses"][0] is not None and want["losses"][1] is None  # layer 1 shares
    for g, w in zip(got["losses"], want["losses"]):
        assert w is None or abs(g - w) <= 1e-5 * abs(w), (g, w)
    largest = max(g.abs().max().item() for g in want["grads"].values())
    assert largest > 0
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        scale = max(grad.abs().max().item(), 1e-2 * largest)
        diff = (got["grads"][name] - grad).abs().max().item()
        assert diff <= 1e-4 * scale, (name, diff, scale)
    indexer = [n for n in want["grads"] if ".indexer." in n]
    assert indexer and all(want["grads"][n].abs().max() > 0 for n in indexer)  # the loss


def test_a_table_of_other_rows_is_refused_on_every_rank() -> None:
    messages = {r["error"] for r in result(SUITE, 2, "refusal-cp2")}
    assert len(messages) == 1, messages  # every rank, the same error
    message = messages.pop()
    assert "rows differs between the inputs" in message and "cos" in message, message
    assert "SparseAttention under CP" in message, message


def test_the_suite_covers_the_issue() -> None:
    cases = [c for w in WORLDS for c in dsa_example_cases(w)]
    assert {c.cp for c in cases} == {1, 2, 3, 4}
    for cp in WORLDS:
        assert {(c.layout, c.packed) for c in cases if c.cp == cp and not c.recompute} == {
            (layout, packed) for layout in ("contiguous", "load_balanced") for packed in (0, 1)
        }
    assert {c.packed for c in cases if c.recompute} == {False, True}


def test_the_example_selects_groups_and_has_no_sink() -> None:
    """The example is what the guide says: k below the rows a query sees, 8 query heads over
    2 KV heads, no sink, layer 1 reusing layer 0's picks."""
    from dsa_example_cases import SEQ, build
    from hp_cp_dsa_example.adapter import SparseAttentionAdapter

    model = build()
    adapters = [SparseAttentionAdapter(layer.self_attn) for layer in model.layers]
    params = [a.attention_params() for a in adapters]
    assert all(p.kind == "grouped" and p.kv_heads == 2 and p.sink is None for p in params)
    assert model.layers[0].self_attn.heads == 8
    assert [a.layer_spec().reuses for a in adapters] == [(), ("selection",), ()]
    assert all(a.indexer_params() is None or a.indexer_params().topk < SEQ // 4 for a in adapters)


def test_the_example_is_registered_only_by_entry_points() -> None:
    models = {ep.name: ep.value for ep in md.entry_points(group="hp_cp.torch_models")}
    assert models["hp_cp_dsa_example.model:SparseAttention"] == (
        "hp_cp_dsa_example.adapter:SparseAttentionAdapter"
    )


def test_the_modeling_file_knows_nothing_of_hp_cp() -> None:
    import hp_cp_dsa_example.model as model

    lines = open(model.__file__).read().splitlines()
    imports = [ln for ln in lines if ln.startswith(("import ", "from "))]
    assert imports and not [ln for ln in imports if "hp_cp" in ln], imports
    assert torch is not None
