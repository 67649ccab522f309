"""The CSA indexer's KL loss: the single-device definition, and CP equal to it.

Single device: the loss equals a per-token loop over the formula of docs/semantics.md section 7
(teacher with the window + sink mass in the denominator, summed over heads, L1-normalised,
sparse over the picks; student log-softmax over the same picks); it trains the indexer only;
coefficient 0 still gives every indexer parameter a (zero) gradient; a loss mask drops rows.

CP (real gloo ranks, cp 2, 3, 4; contiguous and load-balanced; padded and packed; with and
without a loss mask): the loss every rank reads equals the single-device loss within 1e-5
relative, every parameter's gradient summed over ranks within 1e-4, the main branch's
gradients are bitwise the same with coefficient 0.01 and 0, and with coefficient 0 every rank
finishes backward with a zero gradient on every indexer parameter.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from cases import layer_config, rel_err, result
from indexer_loss_cases import (
    COEFFS,
    LossCase,
    build,
    loss_cases,
    single_device_loss,
    training_steps_one_process,
)

from hp_cp_torch.reference import DeepSeekV4Attention, window_indices

INDEXER = "indexer."


def _layer(coeff: float = 0.01, seed: int = 0, topk: int = 3) -> DeepSeekV4Attention:
    torch.manual_seed(seed)
    config = dataclasses.replace(layer_config(4, 8, topk), indexer_loss_coeff=coeff)
    return DeepSeekV4Attention(config)


def _loop_loss(layer: DeepSeekV4Attention, x: torch.Tensor, mask=None) -> float:
    """The loss of a padded batch, token by token, in float64."""
    batch, seq, _ = x.shape
    pos = torch.arange(seq).expand(batch, seq)
    with torch.no_grad():
        q, kv, qr = layer.project(x, pos)
        ind = layer.indexer
        slots = layer._indexer_slots(x, qr, pos)[0]
        q_idx = ind.queries(qr, pos).double()
        w = ind.weights(x).double()
        keys = ind.compressor(x).double()
        ckv = layer.compressor(x).double()
    q, kv = q.double(), kv.double()
    sink = layer.attn_sink.detach().double()
    scale = layer.softmax_scale
    window = window_indices(seq, layer.window_size)
    total, rows = 0.0, 0
    for b in range(batch):
        for t in range(seq):
            if mask is not None and not mask[b, t]:
                continue
            rows += 1
            picks = [int(j) for j in slots[b, t] if j >= 0]
            if not picks:
                continue
            keys_w = [int(i) for i in window[t] if i >= 0]
            target = [0.0] * len(picks)
            for h in range(layer.n_heads):
                win = [scale * float(q[b, t, h] @ kv[b, i]) for i in keys_w] + [float(sink[h])]
                cmp = [scale * float(q[b, t, h] @ ckv[b, j]) for j in picks]
                m = max(win + cmp)
                denom = sum(math.exp(v - m) for v in win + cmp)
                for i, v in enumerate(cmp):
                    target[i] += math.exp(v - m) / denom
            norm = sum(target)
            target = [v / norm for v in target]
            student = [
                sum(
                    float(w[b, t, h]) * max(float(q_idx[b, t, h] @ keys[b, j]), 0.0)
                    for h in range(ind.n_heads)
                )
                for j in picks
            ]
            m = max(student)
            log_z = m + math.log(sum(math.exp(v - m) for v in student))
            total += sum(p * (math.log(p) - (s - log_z)) for p, s in zip(target, student) if p > 0)
    return total / rows


@pytest.mark.parametrize("masked", [False, True])
def test_loss_matches_the_per_token_formula(masked: bool) -> None:
    layer = _layer(topk=2)
    x = torch.randn(2, 29, 32)
    mask = None
    if masked:
        mask = torch.ones(2, 29, dtype=torch.bool)
        mask[1, 20:] = False
    layer(x, loss_mask=mask)
    want = _loop_loss(layer, x, mask)
    assert want > 0
    assert abs(float(layer.indexer_loss) - want) <= 1e-5 * want


def test_packed_loss_is_the_token_weighted_mean_over_documents() -> None:
    layer = _layer()
    x = torch.randn(40, 32)
    cu = torch.tensor([0, 13, 13, 30, 40])
    layer(x, cu_seqlens=cu)
    sums = []
    for a, b in ((0, 13), (13, 30), (30, 40)):
        layer(x[None, a:b])
        sums.append(float(layer.indexer_loss) * (b - a))
    layer(x, cu_seqlens=cu)
    assert abs(float(layer.indexer_loss) - sum(sums) / 40) <= 1e-6


def _grads(layer: DeepSeekV4Attention, x: torch.Tensor, **kw) -> dict[str, torch.Tensor | None]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = layer(x, **kw)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


def test_loss_trains_only_the_indexer_and_scales_with_the_coefficient() -> None:
    x = torch.randn(2, 33, 32)
    g = {c: _grads(_layer(c), x) for c in (0.0, 0.01, 0.02)}
    for name, ref in g[0.0].items():
        if name.startswith(INDEXER):
            assert ref is not None and not ref.any(), f"{name}: coeff 0 must give a zero grad"
            assert g[0.01][name].abs().max() > 0, f"{name} got no gradient from the loss"
            torch.testing.assert_close(g[0.02][name], 2 * g[0.01][name], rtol=1e-5, atol=0)
        else:  # main branch, and x: bitwise unchanged by the loss
            assert torch.equal(g[0.01][name], ref), name


def test_eval_mode_computes_no_loss() -> None:
    layer = _layer().eval()
    x = torch.randn(1, 21, 32)
    grads = _grads(layer, x)
    assert layer.indexer_loss is None
    assert all(grads[n] is None for n in grads if n.startswith(INDEXER))


def test_rows_without_a_visible_slot_give_finite_zero_loss() -> None:
    layer = _layer()
    grads = _grads(layer, torch.randn(1, 3, 32))  # 3 rows < r: no slot at all
    assert float(layer.indexer_loss) == 0.0
    for name, grad in grads.items():
        if name.startswith(INDEXER):
            assert grad is not None and torch.isfinite(grad).all() and not grad.any(), name


def test_fully_masked_batch_gives_zero_loss() -> None:
    layer = _layer()
    x = torch.randn(1, 17, 32)
    _grads(layer, x, loss_mask=torch.zeros(1, 17))
    assert float(layer.indexer_loss) == 0.0


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_loss_survives_activation_recomputation(reentrant: bool) -> None:
    """``layer.indexer_loss`` after backward through ``torch.utils.checkpoint`` is the
    forward's value (a recomputation that stops early must not clear it)."""
    from torch.utils.checkpoint import checkpoint

    layer = _layer().train()
    x = torch.randn(2, 40, layer.config.hidden_size, generator=torch.Generator().manual_seed(3))
    layer(x)
    want = float(layer.indexer_loss)
    out = checkpoint(layer, x.clone().requires_grad_(True), use_reentrant=reentrant)
    out.sum().backward()
    assert layer.indexer_loss is not None
    assert float(layer.indexer_loss) == pytest.approx(want, rel=1e-6)


def test_coefficient_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="indexer_loss_coeff"):
        dataclasses.replace(layer_config(4), indexer_loss_coeff=-1.0)


# ------------------------------------------------------------------ CP against one device

WORLDS = (2, 3, 4)
PARAMS = [pytest.param(w, c, id=c.name) for w in WORLDS for c in loss_cases(w)]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_cp_loss_and_gradients_match_single_device(world: int, case: LossCase) -> None:
    assert_matches_single_device(result("indexer_loss", world, case.name), case)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_a_0_3_third_party_adapter_trains_as_one_process(world: int) -> None:
    """A third party's adapter written against 0.3.0 (``compress(rows, start, state)``, its
    own ``index_scores_at``; ``v03_adapters.py``) runs through 0.4 as before: the same loss
    and gradients as one process as the shipped adapter's."""
    assert_matches_single_device(result("indexer_loss", world, "v03-adapter"), loss_cases(world)[0])


def assert_matches_single_device(per_rank: list, case: LossCase) -> None:
    want = single_device_loss(case, COEFFS[0])
    assert want["loss"] > 0
    for rank, got in enumerate(per_rank):
        loss = got[COEFFS[0]]["loss"]
        assert abs(loss - want["loss"]) <= 1e-5 * want["loss"], (rank, loss, want["loss"])
    assert all(not got[c]["student_warnings"] for got in per_rank for c in COEFFS), per_rank
    got = per_rank[0][COEFFS[0]]
    for name, ref in want["pgrads"].items():
        err = rel_err(got["pgrads"][name], ref)
        assert err <= 1e-4, f"gradient of {name}: relative error {err:.3g} > 1e-4"
    assert rel_err(got["gx"], want["gx"]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_cp_main_branch_is_untouched_and_coeff_zero_gives_zero_grads(
    world: int, case: LossCase
) -> None:
    per_rank = result("indexer_loss", world, case.name)
    with_loss, without = per_rank[0][COEFFS[0]], per_rank[0][COEFFS[1]]
    for name, grad in without["pgrads"].items():
        if not name.startswith(INDEXER):
            assert torch.equal(with_loss["pgrads"][name], grad), name
    assert torch.equal(with_loss["gx"], without["gx"])
    for rank, got in enumerate(per_rank):
        zero = got[COEFFS[1]]
        assert all(zero["has_grad"].values()), (rank, zero["has_grad"])
        assert all(zero["zero"][n] for n in zero["has_grad"]), (rank, zero["zero"])
        assert zero["loss"] == pytest.approx(got[COEFFS[0]]["loss"], rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_a_student_that_scores_otherwise_than_the_selection_warns_once(world: int) -> None:
    """An adapter whose ``index_scores`` differ from the default ``indexer_loss_scores``
    (DeepSeek's formula) would train another score: each rank warns, once per layer."""
    for rank, caught in enumerate(result("indexer_loss", world, "scaled-student")):
        assert len(caught) == 1, (rank, caught)
        assert "differ from index_scores at the same picks" in caught[0], caught[0]
        assert "override it" in caught[0], caught[0]


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
def test_one_handle_over_steps_of_other_real_lengths_and_masks(world: int, layout: str) -> None:
    """Steps padded to the same length with other real lengths (259 after 260), an
    evaluation forward (no loss) between two steps, then a loss mask that changes on one
    rank's rows only: each step equals one process (before, the later layer reused the first
    layer's agreement with a stale count, so one rank, or after an evaluation every rank,
    raised, and the others failed in the next exchange)."""
    per_rank = result("indexer_loss", world, f"steps-{layout}")
    want = training_steps_one_process(world)
    for step, ref in enumerate(want):
        assert ref["loss"] > 0
        for rank, got in enumerate(per_rank):
            loss = got[step]["loss"]
            assert abs(loss - ref["loss"]) <= 1e-5 * ref["loss"], (step, rank, loss, ref)
        got = per_rank[0][step]
        assert rel_err(got["out"], ref["out"]) <= 1e-5, step
        assert rel_err(got["gx"], ref["gx"]) <= 1e-4, step
        for name, grad in ref["grads"].items():
            err = rel_err(got["grads"][name], grad)
            assert err <= 1e-4, f"step {step}: gradient of {name}: relative error {err:.3g}"


def test_suite_covers_the_issue() -> None:
    for world in WORLDS:
        cases = loss_cases(world)
        kinds = {(c.base.layout, c.base.packed, c.masked) for c in cases}
        assert len(kinds) == 8, kinds
    build(loss_cases(2)[0], 0.0)  # the builder honours the coefficient
