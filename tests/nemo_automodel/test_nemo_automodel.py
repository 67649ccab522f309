"""NeMo Automodel 0.7.0's own DeepSeek V4 under hp_cp: the whole ``DeepseekV4ForCausalLM``
(sliding r=0, CSA r=4, HCA r=128 layers, MoE, hyper-connections), a training step at cp 2
and 4 and each attention layer alone at cp 8, contiguous and load-balanced, padded (S = 301)
and packed (NeMo ``seq_lens`` / ``packed_seq_ids``), against the same weights on one process
in the same job: logits, loss, every parameter gradient. Unsupported input (NeMo's own CP
switched on as well, padding masks, bad packing) raises HpCpError on every rank.
"""

from __future__ import annotations

import os

import pytest

if "nemo_automodel" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import nemo_automodel.components.models.deepseek_v4.model  # noqa: F401 - fail, not skip
else:
    pytest.importorskip("nemo_automodel.components.models.deepseek_v4.model", exc_type=ImportError)

import nemo_cases  # noqa: E402 - after the skip
from dist_utils import run_ranks  # noqa: E402

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def model_ranks() -> list[dict]:
    """One 4-rank job: every whole-model case (cp 2 on a sub-group, cp 4 on the world)."""
    return run_ranks(4, nemo_cases.model_suite)


@pytest.fixture(scope="module")
def layer_ranks() -> list[dict]:
    """One 8-rank job: the three attention layers alone at cp 8."""
    return run_ranks(8, nemo_cases.layer_suite)


def _check(res: dict) -> None:
    name = f"{res['case']} cp={res['cp']} {res['layout']}"
    off = {n: e for n, e in res.get("per_param", {}).items() if e >= GRAD_RTOL}
    summary = {k: v for k, v in res.items() if k != "per_param"}
    assert res["logits"] < LOGITS_RTOL, (name, summary)
    assert res["loss"] < LOGITS_RTOL, (name, summary)
    assert res["grads"] < GRAD_RTOL, (name, "gradients off, by parameter:", off)
    assert not res["missing"], (name, summary)


def test_model_parity(model_ranks: list[dict]) -> None:
    results = model_ranks[0]["results"]
    got = {(r["case"], r["cp"], r["layout"]) for r in results}
    want = {
        (k, cp, lay) for k in ("padded", "packed") for cp in (2, 4) for lay in nemo_cases.LAYOUTS
    }
    want |= {("packed_seq_ids", 2, "load_balanced")}
    want |= {
        ("selective packed" if docs else "selective", cp, lay)
        for cp, lay, _, docs in nemo_cases.SELECTIVE_CASES
    }
    assert want == got
    for res in results:
        assert res["n_grads"] > 50  # attention, compressors, MoE, hyper-connections, head
        _check(res)


def test_selective_topk_really_selects() -> None:
    """The selective cases' top-k is far below the visible slots (up to S / 4, or the
    longest document's length / 4)."""
    topk = nemo_cases.SELECTIVE["index_topk"]
    for _, _, seq, docs in nemo_cases.SELECTIVE_CASES:
        assert topk * 5 < (seq if docs is None else max(b - a for a, b in zip(docs, docs[1:]))) // 4
    assert nemo_cases.SELECTIVE["sliding_window"] not in (128, 16)
    assert nemo_cases.SELECTIVE["compress_ratios"][0] == 4


def test_model_traffic_is_counted(model_ranks: list[dict]) -> None:
    for res in model_ranks[0]["results"]:
        if "bytes_recv" in res:
            assert res["bytes_recv"] > 0


def test_layers_alone_at_cp8(layer_ranks: list[dict]) -> None:
    results = layer_ranks[0]["results"]
    assert {r["case"] for r in results} == {"layer 0 r=0", "layer 1 r=4", "layer 2 r=128"}
    for res in results:
        _check(res)


@pytest.mark.parametrize(
    "key, words",
    [
        ("nemo_cp_kwarg", "NeMo Automodel's own DeepSeek V4 CP is switched on"),
        ("nemo_cp_setup", "NeMo Automodel's own DeepSeek V4 CP is switched on"),
        ("nemo_sharder_batch", "NeMo Automodel's own DeepSeek V4 CP is switched on"),
        ("enable_on_nemo_cp", "NeMo Automodel's own DeepSeek V4 CP is switched on"),
        ("padding_mask", "attention mask that hides tokens"),
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
