"""NeMo Automodel 0.7.0's own DeepSeek V4.1 under hp_cp: the whole ``DeepseekV41ForCausalLM``
(sliding-window, Full / Reuse / Reindex layers at ratios 2 and 1, the two-level indexer's
candidate source and a Reindex layer selecting among its candidates, Engram, MoE, mHC), a
training step at cp 2, 3, 4 (one 4-rank job) and 8 (one 8-rank job), contiguous and
load-balanced, padded (S = 301) and packed (NeMo ``seq_lens`` / ``packed_seq_ids``), top-k 4
of up to 301 visible slots, against NeMo's own forward of the same weights on one process:
logits and loss within 1e-5, every parameter gradient within 1e-4, by name. Unsupported
input raises HpCpError on every rank; disable_cp restores the model exactly.
"""

from __future__ import annotations

import os

import pytest

if "nemo_automodel" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import nemo_automodel.components.models.deepseek_v41.model  # noqa: F401 - fail, not skip
else:
    pytest.importorskip("nemo_automodel.components.models.deepseek_v41.model", exc_type=ImportError)

import nemo_v41_cases  # noqa: E402 - after the skip
from dist_utils import run_ranks  # noqa: E402

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def model_ranks() -> list[dict]:
    """One 4-rank job: cp 2 and 3 on sub-groups, cp 4 on the world."""
    return run_ranks(4, nemo_v41_cases.model_suite)


@pytest.fixture(scope="module")
def cp8_ranks() -> list[dict]:
    """One 8-rank job: the whole model at cp 8."""
    return run_ranks(8, nemo_v41_cases.cp8_suite)


@pytest.fixture(scope="module")
def cp1_ranks() -> list[dict]:
    """One 1-rank job: a CP group of one."""
    return run_ranks(1, nemo_v41_cases.cp1_suite)


def _check(res: dict) -> None:
    name = f"{res['case']} cp={res['cp']} {res['layout']}"
    assert res["logits"] < LOGITS_RTOL, (name, res["logits"], res["worst"])
    assert res["loss"] < LOGITS_RTOL, (name, res["loss"])
    bad = {n: e for n, e in res["per_param"].items() if e >= GRAD_RTOL}
    assert not bad, (name, bad)
    assert not res["missing"], (name, res["missing"])


def test_model_parity(model_ranks: list[dict]) -> None:
    results = model_ranks[0]["results"]
    got = {(r["case"], r["cp"], r["layout"]) for r in results}
    want = {
        (k, cp, lay)
        for k in ("padded", "packed")
        for cp in (2, 3, 4)
        for lay in nemo_v41_cases.LAYOUTS
    }
    extra = {("packed_seq_ids", 2, "load_balanced"), ("checkpointed", 3, "load_balanced")}
    assert want | extra == got
    for res in results:
        assert res["n_grads"] > 100  # attention, compressors, Engram, MoE, mHC, head
        _check(res)


def test_model_parity_cp8(cp8_ranks: list[dict]) -> None:
    results = cp8_ranks[0]["results"]
    assert len(results) == 4
    for res in results:
        _check(res)


def test_model_parity_cp1(cp1_ranks: list[dict]) -> None:
    results = cp1_ranks[0]["results"]
    assert len(results) == 4
    for res in results:
        _check(res)


def test_cp1_choice_inputs_bitwise(cp1_ranks: list[dict]) -> None:
    """At cp 1 through the CP path, with each attention layer's output replaced by one
    process's, every input of a discrete choice (fp8 window KV, nvfp4 compressed KV, mxfp4
    index queries and keys, router inputs and picks) and the logits are bitwise one
    process's: the attention kernels' summation order is the only difference, and it stays
    at rounding (a quantization or top-k flip downstream of it is docs/semantics.md's
    "Discrete choices")."""
    got = cp1_ranks[0]["choices"]
    assert got["site_rows"] > 5000, got  # 7 layers' quantizer inputs, 7 routers
    assert got["site_diff"] == 0, got
    assert got["logits_equal"], got
    assert 0 < got["attn_diff"] < 1e-6, got


def test_shared_layers_add_no_slot_exchange(model_ranks: list[dict]) -> None:
    for res in model_ranks[0]["results"]:
        if "slot_exchanges" in res:  # two Full layers: one slot exchange each, forward
            assert res["slot_exchanges"] == 2, res
    # under activation checkpointing the two Full layers run their forward again in
    # backward; the Reuse / Reindex layers, recomputed first, still read what they own
    (ckpt,) = [r for r in model_ranks[0]["results"] if r["case"] == "checkpointed"]
    assert ckpt["checkpointed_slot_exchanges"] == 4


KV = ["compressed_kv", "index_keys"]


def test_the_sharing_plan_says_who_owns_what(model_ranks: list[dict]) -> None:
    """The schedule (SWA, Full, Reuse, Reindex at ratio 2; Full + candidate source, Reindex,
    Reuse at ratio 1) as the core's one sharing plan."""
    tables = [res["sharing"] for res in model_ranks[0]["results"] if "sharing" in res]
    assert len(tables) == 12  # cp 2, 3, 4 x both layouts x padded, packed
    for rows in tables:
        table = {row["layer"]: row for row in rows}
        assert table[0] == {
            "layer": 0, "makes": [], "owners": {}, "readers": {}, "exchanges": ["halo"]
        }  # fmt: skip
        for full in (1, 4):
            assert table[full]["exchanges"] == ["halo", "slots"]
        assert table[1]["makes"] == [*KV, "selection"]
        assert table[1]["readers"] == {"compressed_kv": [2, 3], "index_keys": [2, 3],
                                       "selection": [2]}  # fmt: skip
        assert table[2]["owners"] == {"compressed_kv": 1, "index_keys": 1, "selection": 1}
        assert table[3]["owners"] == {"compressed_kv": 1, "index_keys": 1, "selection": 3}
        assert table[4]["makes"] == [*KV, "selection", "candidates"]
        assert table[5]["owners"] == {
            "compressed_kv": 4, "index_keys": 4, "selection": 5, "candidates": 4
        }  # fmt: skip
        assert table[6]["owners"] == {"compressed_kv": 4, "index_keys": 4, "selection": 5}
        for shared in (2, 3, 5, 6):  # no slot collective of their own
            assert table[shared]["exchanges"] == ["halo"]


@pytest.mark.parametrize(
    "key, words",
    [
        ("nemo_cp_kwarg", "NeMo Automodel's own DeepSeek V4.1 CP is switched on"),
        ("nemo_cp_setup", "NeMo Automodel's own DeepSeek V4.1 CP is switched on"),
        ("enable_on_nemo_cp", "NeMo Automodel's own DeepSeek V4.1 CP is switched on"),
        ("padding_mask", "attention_mask that hides real tokens"),
        ("seq_lens_sum", "summing to the sequence length 301"),
        ("packed_batch", "pack the documents of a step into one row"),
    ],
)
def test_errors_on_every_rank(model_ranks: list[dict], key: str, words: str) -> None:
    for report in model_ranks:
        assert words in report["errors"][key], (report["rank"], report["errors"][key])


def test_usable_after_errors_and_restored_exactly(model_ranks: list[dict]) -> None:
    for report in model_ranks:
        assert report["errors"]["after_errors"] == "ok"
        assert report["restore"] == {"same_output": True, "same_attrs": True, "same_hooks": True}
