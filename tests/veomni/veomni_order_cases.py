"""Rank functions of tests/veomni/test_veomni_forward_records.py: every record belongs to its
forward (Note [Records per forward] in ``hp_cp_core.records``) in VeOmni 0.1.12's DeepSeek V4.

VeOmni's ``DeepseekV4ForCausalLM`` (the tiny fp32 build of ``veomni_cases``: sliding, CSA
r = 4, HCA r = 128, hash MoE, hyper-connections) with every decoder layer recomputed in
backward, switched on as VeOmni's ``build_parallelize_model(enable_gradient_checkpointing=
True)`` does (``veomni.distributed.torch_parallelize``): ``gradient_checkpointing_enable``
with ``use_reentrant`` (``reentrant``: torch's reentrant checkpoint) or not
(``nonreentrant``: ``early_stop=True``), ``context_fn=noop_context_fn``. (With
``enable_reentrant`` VeOmni also swaps in its own ``CheckpointFunction``, an FSDP1 patch that
reads ``run_function.__self__``: on one process, without hp_cp, it raises AttributeError on
the ``functools.partial`` that transformers 5.9's ``GradientCheckpointingLayer`` passes, so
the reentrant cases run torch's own.)

Two forwards on batches A and B (real lengths that pad to the same rows), then the backwards
in both orders, or A, an evaluation forward of B, then A's backward (``forward_order_cases``
in tests/torch), through ``cp_veomni_batch``. Each case runs the same calls on one process (the
reference) and under CP and compares every gradient by name (floor: ``veomni_cases.GRAD_FLOOR``,
1e-3 of the largest gradient). The model has no indexer loss and its padding rows follow every
real row, so a wrong padding record would move no number here (with the record lookup replaced
by "the latest forward's" every case still passes): these cases check that the recomputation
runs, raises nothing and frees its records.
"""

from __future__ import annotations

import copy
import gc
import time
from typing import Any

import torch
import torch.distributed as dist
from veomni_cases import GRAD_FLOOR, build_model, init_veomni

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
from hp_cp_torch.integrations.veomni import (
    cp_causal_lm_loss,
    cp_shift_labels,
    cp_sum_gradients,
    cp_veomni_batch,
)

__all__ = ["MODES", "ORDERS", "order_suite"]

ORDERS = ("fwd_fwd_bwd_bwd", "fwd_fwd_bwdB_bwdA", "fwd_eval_bwd")  # forward_order_cases.py's
MODES = ("reentrant", "nonreentrant")
SEEDS = (1, 3)  # the token ids of batches A and B
BASE_LENGTH = 133
"""About the real length of a case's batches: one HCA slot (r = 128), 33 CSA slots (top-k 4)."""

_BUILT: list[torch.nn.Module] = []


def build() -> torch.nn.Module:
    """A fresh copy of the tiny fp32 VeOmni model (built once per process)."""
    if not _BUILT:
        _BUILT.append(build_model(0))
    return copy.deepcopy(_BUILT[0])


def recompute(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Every decoder layer recomputed in backward, as VeOmni switches it on (``none``: not
    recomputed, the control)."""
    if mode == "none":
        return model
    from torch.utils.checkpoint import noop_context_fn

    kwargs: dict[str, Any] = {"use_reentrant": mode == "reentrant", "context_fn": noop_context_fn}
    if mode == "nonreentrant":
        kwargs["early_stop"] = True
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def lengths(cp: int, layout: str) -> tuple[int, int]:
    """Two real lengths that pad to the same rows under ``layout`` over ``cp`` ranks, the
    first a multiple of nothing."""
    unit = 2 * cp if layout == "load_balanced" else cp
    padded = -(-BASE_LENGTH // unit) * unit
    return padded - unit + 1, padded - 1


def _ids(vocab: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))


def _loss_one(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One process: VeOmni's own forward, mean cross entropy over the shifted targets."""
    out = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False)
    labels = cp_shift_labels(ids)
    return cp_causal_lm_loss(out.logits, labels, (labels != -100).sum())


def _run_order(order: str, model: torch.nn.Module, loss_of: Any, a: Any, b: Any) -> list[float]:
    """The calls of ``order`` with ``loss_of(batch)`` as the forward and loss."""
    model.train()
    loss_a = loss_of(a)
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


def order_case(group: Any, layout: str, order: str, mode: str) -> dict[str, Any]:
    """One case: worst per-parameter relative gradient error (floor ``GRAD_FLOOR`` of the
    largest gradient) and loss error, CP against one process doing the same calls."""
    start = time.perf_counter()
    cp = dist.get_world_size(group)
    model = recompute(build(), mode)
    len_a, len_b = lengths(cp, layout)
    vocab = model.config.vocab_size
    ids_a, ids_b = _ids(vocab, len_a, SEEDS[0]), _ids(vocab, len_b, SEEDS[1])
    want_losses = _run_order(order, model, lambda ids: _loss_one(model, ids), ids_a, ids_b)
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    handle = enable_cp(model, group, DeepSeekV4CPConfig(layout=layout))
    try:

        def loss_cp(ids: torch.Tensor) -> torch.Tensor:
            batch = cp_veomni_batch(handle, ids)
            out = model(**batch.model_inputs(), use_cache=False)
            return cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)

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
    """Every ``(cp, layout, order, mode)`` of ``cases`` on its sub-group (cp 2: ranks 0-1;
    cp 3: ranks 0-2); ranks outside a case's group skip it."""
    torch.set_num_threads(1)
    init_veomni(world)  # VeOmni's parallel state, its own CP off
    groups = {cp: dist.new_group(list(range(cp))) for cp in (2, 3) if cp <= world}
    build()
    gc.collect()
    gc.freeze()  # each case's gc.collect() then skips the imported modules
    out = []
    for cp, layout, order, mode in cases:
        if rank < cp:
            try:
                out.append(order_case(groups[cp], layout, order, mode))
            except Exception as exc:  # noqa: BLE001 - reported by case (ranks raise alike)
                case = dict(cp=cp, layout=layout, order=order, mode=mode)
                out.append({**case, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        dist.barrier()
    return out
