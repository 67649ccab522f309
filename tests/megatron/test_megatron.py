"""megatron-core 0.19.2's ``GPTModel`` of MLA + DSA layers (built from Megatron's own spec, with
Megatron's loss) under hp_cp, through Megatron's ``forward_backward_func``, against the same
model, weights and batch on one process at ``context_parallel_size=1`` in the same job:

* cp 1 (the CP path, no bypass), 2, 3 and 4, each one spawned gloo job
  (``megatron_cases.megatron_suite``); contiguous and load-balanced; padded (batch 2) and packed
  THD (``PackedSeqParams``, batch 1, four documents, one of a single token); S = 61, top-k 8;
* Megatron's dense indexer loss at every cp x layout x padded / packed, and per cp a few of
  the sparse loss, IndexShare (``dsa_indexer_topk_freq=2``) and ``calculate_per_token_loss``;
  ``dsa_indexer_loss_coeff=0.1`` throughout, so the indexer's gradients are compared too;
* per cp a case or two with ``attention_kernel="megatron"`` (Megatron's own sparse attention,
  its unfused CPU path, on hp_cp's exchange; IndexShare's shared picks at cp 3), which must
  call Megatron's ``_run_sparse_attention`` (the other cases never do);
* fp32: the loss, the logits and the indexer loss Megatron logs to 1e-5, every parameter
  gradient by name to 1e-4 of that parameter's largest one-process gradient (floored at 1e-2
  of the largest of all);
* refused on every rank: Megatron's CP group not hp_cp's, an attention mask, a batch
  Megatron's ``get_batch_on_this_cp_rank`` sharded;
* at cp 2 and 3, both layouts, with Megatron's full activation recomputation
  (``recompute_granularity="full"``, uniform, one layer): forwards of A (S = 61, batch 2) and B
  (S = 47, batch 1), then the backwards in both orders; and A's forward, an evaluation forward
  of B under ``torch.no_grad``, then A's backward; with Megatron's selective recomputation
  (``layernorm``, ``mla_up_proj``, ``core_attn``, ``mlp``) the first order, and with each
  ``TransformerLayer`` in torch's non-reentrant ``checkpoint_wrapper`` the second; the losses
  and every gradient after each backward against one process running the same calls.

Skipped when megatron-core is absent, unless ``HP_CP_REQUIRE_BACKEND`` contains ``megatron``
(the ``megatron`` nox session sets it).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if "megatron" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import megatron.core  # noqa: F401 - must be importable: fail, not skip
else:
    pytest.importorskip("megatron.core", exc_type=ImportError)

import megatron_cases  # noqa: E402 - after the skip
from megatron_model import SMALL  # noqa: E402

from hp_cp_torch.cli.launch import run_ranks  # noqa: E402

RTOL = 1e-5
GRAD_RTOL = 1e-4
CPS = (1, 2, 3, 4)


@pytest.fixture(scope="module", params=CPS, ids=[f"cp{cp}" for cp in CPS])
def suite(request: pytest.FixtureRequest) -> dict:
    """One job of ``cp`` ranks for every case of that cp; rank 0's results."""
    return run_ranks(request.param, megatron_cases.megatron_suite)[0]


def _id(res: dict) -> str:
    return f"cp={res['cp']} {res['variant']} {res['layout']} {res['docs']}"


@pytest.mark.slow
def test_every_case_ran(suite: dict) -> None:
    cp = suite["results"][0]["cp"]
    got = [(r["variant"], r["layout"], r["docs"]) for r in suite["results"]]
    assert got == megatron_cases.cases_for(cp)
    assert {r["cp"] for r in suite["results"]} == {cp}
    assert megatron_cases.TOPK < megatron_cases.SEQ // 2  # top-k really selects


@pytest.mark.slow
def test_loss_logits_and_gradients_match_one_process(suite: dict) -> None:
    for res in suite["results"]:
        assert res["loss_abs_err"] <= RTOL * abs(res["loss"]), _id(res)
        assert res["logits_abs_err"] <= RTOL * res["logits_scale"], _id(res)
        assert res["grad_rel_err_max"] <= GRAD_RTOL, (_id(res), res["grad_rel_err_worst_param"])
        # the indexer is compared with its loss on: it has gradients, and they match
        layers = SMALL["num_layers"] // (2 if res["variant"].endswith("topk_freq2") else 1)
        assert res["indexer_params"] == 5 * layers, _id(res)
        assert res["indexer_grad_norm"] > 0, _id(res)
        assert res["indexer_grad_rel_err_max"] <= GRAD_RTOL, _id(res)
        # the indexer loss Megatron logs (its tracker, summed over the CP group), per layer
        logged = [v for v in res["indexer_loss"] if v != 0]
        assert len(logged) == layers, _id(res)
        assert res["indexer_loss_abs_err"] <= RTOL * max(logged), _id(res)
        # attention_kernel="megatron": Megatron's own sparse attention ran, once per chunk
        own_kernel = res["variant"].startswith("megatron_kernel")
        assert (res["megatron_kernel_calls"] > 0) == own_kernel, _id(res)


@pytest.mark.slow
def test_the_latents_move_not_per_head_keys_and_values(suite: dict) -> None:
    """What a rank sends is whole rows of [latent (kv_lora_rank + rope) ; indexer key] per
    token (fp32), never the heads' expanded keys and values."""
    row = 4 * (SMALL["kv_lora_rank"] + SMALL["qk_pos_emb_head_dim"] + SMALL["dsa_indexer_head_dim"])
    for res in suite["results"]:
        if res["cp"] == 1:
            assert res["bytes_sent"] == 0, _id(res)
        elif not res["variant"].endswith("topk_freq2"):
            assert res["bytes_sent"] > 0 and res["bytes_sent"] % row == 0, _id(res)


@pytest.mark.slow
def test_unsupported_setups_are_refused_on_every_rank(suite: dict) -> None:
    if suite["results"][0]["cp"] != 2:
        pytest.skip("the cp 2 job runs the refusals")
    assert suite["errors"] == {
        "megatron_cp_1": "ok",
        "attention_mask": "ok",
        "megatron_sharded_batch": "ok",
    }


@pytest.mark.slow
def test_recomputed_layers_read_their_own_forward(suite: dict) -> None:
    """Megatron's recomputation with another forward (S = 47, batch 1) between A's forward
    (S = 61, batch 2) and its backward (the backwards in both orders), or an evaluation
    forward of B under ``torch.no_grad``: the losses and every gradient after each backward
    match one process running the same calls (each recomputed layer reads its own forward's
    positions)."""
    cp = suite["results"][0]["cp"]
    got = [(r["order"], r["layout"], r["recompute"]) for r in suite["orders"]]
    assert got == megatron_cases.order_cases_for(cp)
    for res in suite["orders"]:
        name = f"cp={res['cp']} {res['order']} {res['layout']} {res['recompute']}"
        assert "error" not in res, (name, res.get("error"))
        assert res["backwards"] == (1 if res["order"] == "fwd_eval_bwd" else 2), name
        assert res["loss_rel_err"] <= RTOL, name
        assert res["grad_rel_err_max"] <= GRAD_RTOL, (name, res["grad_rel_err_worst"])
