"""Rank functions of tests/nemo_automodel/test_nemo_forward_records.py: every record belongs to
its forward (Note [Records per forward] in ``hp_cp_core.records``) in NeMo Automodel 0.7.0's
own models.

NeMo's ``DeepseekV4ForCausalLM`` (sliding, CSA r = 4, HCA r = 128), ``DeepseekV41ForCausalLM``
(its Full / Reuse / Reindex layers read what an earlier layer of the same forward published)
and ``GlmMoeDsaForCausalLM`` (its shared indexer layers reuse a full layer's selection), the
tiny fp32 builds of ``nemo_cases`` / ``nemo_v41_cases`` / ``nemo_dsa_cases``, with every
decoder block recomputed in backward:

* ``nemo_ac``: NeMo's own activation checkpointing (``apply_ac`` of
  ``nemo_automodel.components.moe.parallelizer``, as its MoE parallelizer applies it:
  ``checkpoint_wrapper`` non-reentrant with its policy that saves the router's projection
  and top-k);
* ``reentrant`` / ``nonreentrant``: torch's ``checkpoint_wrapper`` of each block.

Two forwards on batches A and B (real lengths that pad to the same rows), then the backwards
in both orders, or A, an evaluation forward of B, then A's backward (``forward_order_cases``
in tests/torch), or two plain steps (``fwd_bwd_fwd_bwd``), through ``cp_nemo_batch``. Each
case runs the same calls on one process (the reference) and under CP and compares every
gradient by name (floor: 1e-2 of the largest).

What a wrong record would cost: with the record lookup replaced by "the latest forward's",
GLM-5's shared layers are 1.3 off and V4.1's ranks hang; V4's numbers do not move (it has no
indexer loss, and its padding rows follow every real row, so no real row reads them): its
cases check the recomputation runs, raises nothing and frees its records.
"""

from __future__ import annotations

import copy
import gc
import os
import time
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo's fp32 RMSNorm is a compiled op

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
from hp_cp_torch.integrations.nemo_automodel import (
    cp_causal_lm_loss,
    cp_nemo_batch,
    cp_sum_gradients,
)

__all__ = ["MODES", "MODELS", "ORDERS", "order_suite"]

ORDERS = ("fwd_fwd_bwd_bwd", "fwd_fwd_bwdB_bwdA", "fwd_eval_bwd")  # forward_order_cases.py's
MODELS = ("v4", "v41", "glm5")
MODES = ("nemo_ac", "reentrant", "nonreentrant")
GRAD_FLOOR = 1e-2  # nemo_cases.GRAD_FLOOR
SEEDS = (1, 3)
"""The token ids of batches A and B. (V4.1 on the ids of seed 2 differs from one process by
5.7e-5 in ``engram.embed.weight`` at cp 2 and 3 without any recomputation, in every order.)"""
BASE_LENGTH = {"v4": 133, "v41": 45, "glm5": 41}
"""About the real length of a case's batches: V4's 133 holds one HCA slot (r = 128) and 33
CSA slots (top-k 8); V4.1's and GLM-5's top-k 4 really select at 45 / 41."""


_BUILT: dict[str, torch.nn.Module] = {}


def build(kind: str) -> torch.nn.Module:
    """A fresh copy of the tiny fp32 NeMo model of ``kind`` (the same weights on every rank;
    built once per process: V4.1's build alone takes seconds)."""
    if kind not in _BUILT:
        if kind == "v4":
            import nemo_cases

            _BUILT[kind] = nemo_cases.build_model(0)
        elif kind == "v41":
            import nemo_v41_cases

            _BUILT[kind] = nemo_v41_cases.build_model(0)
        else:
            import nemo_dsa_cases

            _BUILT[kind] = nemo_dsa_cases.build_glm(0)
    return copy.deepcopy(_BUILT[kind])


def recompute(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Every decoder block of ``model`` recomputed in backward, the ``mode`` way (``none``:
    not recomputed, the control)."""
    if mode == "none":
        return model
    if mode == "nemo_ac":
        from nemo_automodel.components.moe.parallelizer import apply_ac

        apply_ac(model)
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if mode == "reentrant" else CheckpointImpl.NO_REENTRANT
    layers = model.model.layers
    for key in list(layers.keys()):
        layers[key] = checkpoint_wrapper(layers[key], checkpoint_impl=impl)
    return model


def lengths(kind: str, cp: int, layout: str) -> tuple[int, int]:
    """Two real lengths that pad to the same rows under ``layout`` over ``cp`` ranks, the
    first a multiple of nothing."""
    unit = 2 * cp if layout == "load_balanced" else cp
    padded = -(-BASE_LENGTH[kind] // unit) * unit
    return padded - unit + 1, padded - 1


def _ids(vocab: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))


def _loss_one(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One process: NeMo's own forward, mean cross entropy over the shifted targets."""
    logits = model(ids).logits.float()
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )
    return total / (targets != -100).sum()


def _run_order(order: str, model: torch.nn.Module, loss_of: Any, a: Any, b: Any) -> list[float]:
    """The calls of ``order`` with ``loss_of(batch)`` as the forward and loss."""
    model.train()
    loss_a = loss_of(a)
    if order == "fwd_bwd_fwd_bwd":  # two plain training steps: nothing in between
        loss_a.backward()
        loss_b = loss_of(b)
        loss_b.backward()
        return [float(loss_a), float(loss_b)]
    if order == "fwd_eval_bwd":
        model.eval()
        with torch.no_grad():
            loss_of(b)
        model.train()
        loss_a.backward()
        return [float(loss_a)]
    loss_b = loss_of(b)
    first, second = (loss_a, loss_b) if order == "fwd_fwd_bwd_bwd" else (loss_b, loss_a)
    first.backward()
    second.backward()
    return [float(loss_a), float(loss_b)]


def order_case(kind: str, group: Any, layout: str, order: str, mode: str) -> dict[str, Any]:
    """One case: worst per-parameter relative gradient error (floor 1e-2 of the largest
    gradient) and loss error, CP against one process doing the same calls."""
    start = time.perf_counter()
    cp = dist.get_world_size(group)
    model = recompute(build(kind), mode)
    vocab = model.config.vocab_size if kind != "v41" else model.config.text_config.vocab_size
    len_a, len_b = lengths(kind, cp, layout)
    ids_a, ids_b = _ids(vocab, len_a, SEEDS[0]), _ids(vocab, len_b, SEEDS[1])
    want_losses = _run_order(order, model, lambda ids: _loss_one(model, ids), ids_a, ids_b)
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    handle = enable_cp(model, group, DeepSeekV4CPConfig(layout=layout))
    try:

        def loss_cp(ids: torch.Tensor) -> torch.Tensor:
            batch = cp_nemo_batch(handle, ids)
            labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
            return cp_causal_lm_loss(model(**batch).logits, labels, n_tokens)

        got_losses = _run_order(order, model, loss_cp, ids_a, ids_b)
        cp_sum_gradients(model.parameters(), group)
        gc.collect()
        live = len(handle.records.live())  # the graphs are gone: only the latest is kept
    finally:
        disable_cp(handle)
    totals = torch.tensor(got_losses)
    dist.all_reduce(totals, group=group)
    scale = max(float(g.abs().max()) for g in want.values())
    errors = {}
    for n, p in model.named_parameters():
        ref, got = want.get(n), p.grad
        if ref is None and got is None:
            continue
        ref = torch.zeros_like(p) if ref is None else ref
        got = torch.zeros_like(p) if got is None else got
        floor = max(float(ref.abs().max()), GRAD_FLOOR * scale)
        errors[n] = float((got - ref).abs().max()) / floor
    worst = max(errors, key=errors.get)
    return {
        "kind": kind,
        "cp": cp,
        "layout": layout,
        "order": order,
        "mode": mode,
        "lengths": (len_a, len_b),
        "loss_err": max(abs(g - w) / abs(w) for g, w in zip(totals.tolist(), want_losses)),
        "grad_err": errors[worst],
        "worst": worst,
        "n_grads": len(errors),
        "live_records": live,
        "seconds": time.perf_counter() - start,
    }


def order_suite(rank: int, world: int, cases: list[tuple]) -> list[dict[str, Any]]:
    """Every ``(kind, cp, layout, order, mode)`` of ``cases`` on its sub-group (cp 2: ranks
    0-1; cp 3: ranks 0-2); ranks outside a case's group skip it."""
    torch.set_num_threads(1)
    groups = {cp: dist.new_group(list(range(cp))) for cp in (2, 3) if cp <= world}
    for kind in dict.fromkeys(case[0] for case in cases):
        build(kind)
    gc.collect()
    gc.freeze()  # each case's gc.collect() then skips the imported modules (1.3 s a case)
    out = []
    for kind, cp, layout, order, mode in cases:
        if rank < cp:
            try:
                out.append(order_case(kind, groups[cp], layout, order, mode))
            except Exception as exc:  # noqa: BLE001 - reported by case (ranks raise alike)
                case = dict(kind=kind, cp=cp, layout=layout, order=order, mode=mode)
                out.append({**case, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        dist.barrier()
    return out
