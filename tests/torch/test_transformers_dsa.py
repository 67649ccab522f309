"""transformers' DSA models under CP: the whole ``DeepseekV32ForCausalLM`` (DeepSeek V3.2) and
``GlmMoeDsaForCausalLM`` (GLM-5, a full indexer layer and two layers sharing its selection),
tiny fp32 configs, on cp 1, 2, 3, 4 and 8 (one 8-rank gloo job), contiguous and load-balanced,
padded (batch 2) and packed (batch 1), S = 37 (a multiple of nothing), 4 indexer heads and
top-k 4 of up to 37 visible tokens (exact top-k ties at the boundary do occur: hp_cp picks as
HF's ``torch.topk`` does on one process), against the same model and weights on one process:
logits and loss 1e-5, every parameter gradient 1e-4 (by name), the loss after one SGD step at
cp 4; load-balanced cases attend in query chunks of 5 rows; extra cases re-gather the latents
in backward (cp 3), run transformers' activation checkpointing (cp 4), or both (cp 2).

Skipped when transformers 5.23's DSA models are absent, unless ``HP_CP_REQUIRE_BACKEND``
contains ``transformers``.
"""

from __future__ import annotations

import os

import pytest

if "transformers" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import transformers.models.deepseek_v32  # noqa: F401 - must be importable: fail, not skip
    import transformers.models.glm_moe_dsa  # noqa: F401
else:
    pytest.importorskip("transformers.models.glm_moe_dsa", exc_type=ImportError)

import dsa_cases  # noqa: E402 - after the skip
from dist_utils import run_ranks  # noqa: E402

RTOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def suite() -> dict:
    """One 8-rank job for every case; rank 0 took part in every case."""
    return run_ranks(8, dsa_cases.dsa_suite)[0]


def _id(res: dict) -> str:
    return f"{res['model']} {res['docs']} cp={res['cp']} {res['layout']} {res['variant']}"


@pytest.mark.slow
def test_every_case_ran_and_the_indexer_selects(suite: dict) -> None:
    got = {(r["model"], r["docs"], r["cp"], r["layout"], r["variant"]) for r in suite["results"]}
    want = {
        (m, d, cp, lay, "plain")
        for m in dsa_cases.MODELS
        for d in ("padded", "packed")
        for cp in (1, 2, 3, 4, 8)
        for lay in dsa_cases.LAYOUTS
    } | {
        (m, d, cp, "load_balanced", v)
        for m in dsa_cases.MODELS
        for d in ("padded", "packed")
        for cp, variants in dsa_cases.VARIANTS.items()
        for v in variants
    }
    assert got == want
    for key, ref in suite["references"].items():
        assert ref["rows_selecting"] > 0, key  # top-k < visible tokens on many rows
    # the k-th and (k+1)-th best visible scores tie exactly on some rows: the picks then
    # depend on torch.topk's row, which hp_cp rebuilds (Note [The one-process top-k row])
    ties = {key: ref["boundary_ties"] for key, ref in suite["references"].items()}
    assert sum(ties.values()) > 0, ties


@pytest.mark.slow
def test_logits_loss_and_step_match_one_process(suite: dict) -> None:
    for res in suite["results"]:
        assert not res["bypassed"], _id(res)  # cp 1 included: the CP path
        # re-gathered: the attention saved the gathered latents as views to receive again
        assert (res["regather_saved_views"] > 0) == ("regather" in res["variant"]), _id(res)
        assert res["logits_rel_err"] <= RTOL, _id(res)
        assert res["loss_rel_err"] <= RTOL, _id(res)
        if res["loss2_rel_err"] is not None:
            assert res["loss2_rel_err"] <= RTOL, _id(res)


@pytest.mark.slow
def test_every_parameter_gradient_matches_one_process(suite: dict) -> None:
    for res in suite["results"]:
        assert res["grad_presence_mismatch"] == [], _id(res)
        bad = {n: e for n, e in res["grad_rel_err"].items() if e > GRAD_RTOL}
        assert bad == {}, (_id(res), bad)
        # HF's indexer runs under no_grad: it gets no gradient, under CP or not
        assert all(".indexer." in n for n in res["params_without_grad"]), _id(res)


@pytest.mark.slow
def test_one_exchange_per_layer_and_the_shared_layers_move_no_index_keys(suite: dict) -> None:
    for res in suite["results"]:
        layers = 3
        assert "halo_exchange" not in res["collectives"], _id(res)
        if res["cp"] > 1:  # a group of one exchanges nothing
            # activation checkpointing runs each layer's forward again in backward
            runs = 2 if "checkpointing" in res["variant"] else 1
            assert res["collectives"].get("slot_exchange") == layers * runs, _id(res)
        if res["model"] == "glm_moe_dsa":
            table = res["sharing"]
            assert table[0]["readers"] == {"selection": [1, 2]}
            for row in table[1:]:
                assert row["owners"] == {"compressed_kv": row["layer"], "selection": 0}
                assert row["makes"] == ["compressed_kv"]


@pytest.mark.slow
def test_errors_and_disable_cp(suite: dict) -> None:
    for kind, errors in suite["errors"].items():
        want = {"use_cache": "ok", "packed_batch_2": "ok", "packed_cu_start": "ok"}
        assert errors == {**want, "restored": True}, kind


@pytest.mark.parametrize("kind", dsa_cases.MODELS)
def test_bf16_is_as_close_to_fp32_as_one_process(suite: dict, kind: str) -> None:
    """bf16 (five seeds; cp 4 load-balanced, cp 3 contiguous, cp 4 packed): judged across the
    seeds, CP's error against the fp32 model over one process's in bf16 is at most 1.25 for
    the loss (or both under three standard errors of the token mean) and the logits'
    per-token RMS, at most 2 for every parameter of more than 64 entries, 1.5 in geometric
    mean for the small ones (Note [Judging bf16 precision across seeds] in
    hp_cp_torch.bench.precision)."""
    summary = suite["bf16"][kind]
    want = {"cp4_load_balanced", "cp3_contiguous", "cp4_load_balanced_packed"}
    assert set(summary["cases"]) == want
    for label, case in summary["cases"].items():
        assert all(case["ok"].values()), (label, case["ok"], case["large_params_over_2x"])
    for seed in summary["per_seed"]:
        one = seed["runs"]["one_process"]
        assert 0 < one["logits_rms"] < 0.5, one  # bf16 really ran, and ran sanely
