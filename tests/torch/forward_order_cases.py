"""Rank functions of tests/torch/test_forward_records.py: every record belongs to its forward.

Two forwards (batches A and B whose real lengths pad to the same rows), then the backwards
in both orders, or a forward of A, an evaluation forward of B, then A's backward; with
transformers' activation checkpointing (reentrant and not), so each recomputed layer runs
after the other forward. Each case runs the same calls on one process (the reference) and
under CP, and compares every gradient by name (Note [The floor] in ``cases.py``).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch
import torch.distributed as dist

from hp_cp_core import CPConfig, disable_cp, enable_cp
from hp_cp_torch.integrations.transformers import cp_sum_gradients
from hp_cp_torch.integrations.transformers_dsa import cp_causal_lm_loss

ORDERS = ("fwd_fwd_bwd_bwd", "fwd_fwd_bwdB_bwdA", "fwd_eval_bwd")
MODELS = ("deepseek_v4", "deepseek_v32", "glm_moe_dsa", "reference", "reference_fsdp")


class ReferenceStack(torch.nn.Module):
    """Reference layers r = 0, 4 (with the indexer loss), 128, each recomputed in backward
    (``torch.utils.checkpoint`` of the layer call) when ``reentrant`` is not ``None``; the
    padding ``handle.shard`` appends is left out of the indexer loss, so a recomputed layer
    reading another forward's padding would train the indexer wrongly."""

    def __init__(self) -> None:
        super().__init__()
        from cases import layer_config

        from hp_cp_torch.reference import DeepSeekV4Attention

        torch.manual_seed(77)
        self.layers = torch.nn.ModuleList(
            DeepSeekV4Attention(dataclasses.replace(layer_config(r), indexer_loss_coeff=0.5))
            for r in (0, 4, 128)
        )
        self.reentrant: bool | None = None
        self.wrapped = False

    def wrap(self, reentrant: bool) -> None:
        """Each layer in torch's ``checkpoint_wrapper`` (what FSDP recipes apply), which
        recomputes it in backward on its own."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
        self.layers = torch.nn.ModuleList(
            checkpoint_wrapper(layer, checkpoint_impl=impl) for layer in self.layers
        )
        self.wrapped = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            if self.reentrant is None or not self.training or self.wrapped:
                x = x + layer(x)
            else:
                x = x + checkpoint(layer, x, use_reentrant=self.reentrant)
        return x


def _stack_inputs(seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, seq, 32, generator=gen), torch.randn(1, seq, 32, generator=gen)


def build(kind: str, seed: int = 0) -> Any:
    """The tiny fp32 eager model of ``kind`` (the same weights on every rank)."""
    if kind == "deepseek_v4":
        from hp_cp_torch.cli.parity import build_tiny_model

        return build_tiny_model(seed, sliding_window=8)
    from dsa_cases import build_dsa_model

    return build_dsa_model(kind, seed)


def lengths(cp: int, layout: str) -> tuple[int, int]:
    """Two real lengths that pad to the same rows under ``layout`` over ``cp`` ranks, the
    first a multiple of nothing."""
    unit = 2 * cp if layout == "load_balanced" else cp
    padded = -(-41 // unit) * unit
    return padded - unit + 1 if unit > 1 else 41, padded - 1 if unit > 1 else 40


def _ids(vocab: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))


def _loss_one(model: Any, ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    out = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False)
    return cp_causal_lm_loss(out.logits, labels, (labels != -100).sum())


def _run_order(order: str, model: Any, loss_of: Any, a: Any, b: Any) -> list[float]:
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


def order_case(
    kind: str, group: Any, layout: str, order: str, reentrant: bool | None
) -> dict[str, Any]:
    """One case: worst per-parameter relative gradient error (floor 1e-2 of the largest
    gradient) and loss errors, CP against one process doing the same calls."""
    cp = dist.get_world_size(group)
    len_a, len_b = lengths(cp, layout)
    if kind.startswith("reference"):
        model = ReferenceStack()
        model.reentrant = reentrant
        if kind == "reference_fsdp":
            model.wrap(bool(reentrant))
        ids_a, ids_b = _stack_inputs(len_a, 1), _stack_inputs(len_b, 2)
        loss_one = lambda xg: (model(xg[0].requires_grad_()) * xg[1]).sum()  # noqa: E731
    else:
        model = build(kind)
        vocab = model.config.vocab_size
        ids_a, ids_b = _ids(vocab, len_a, 1), _ids(vocab, len_b, 2)
        if reentrant is not None:
            model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        loss_one = lambda ids: _loss_one(model, ids)  # noqa: E731
    want_losses = _run_order(order, model, loss_one, ids_a, ids_b)
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    config = CPConfig(layout=layout, single_rank_bypass=False)
    handle = enable_cp(model, group, config)
    fsdp = kind == "reference_fsdp"
    if fsdp:  # FSDP2 over the CP ranks (it averages their gradients: the loss times cp)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
            # the indexer loss rides on the output's gradient unscaled: weigh it by cp too
            inner = layer._checkpoint_wrapped_module
            inner.config = dataclasses.replace(
                inner.config, indexer_loss_coeff=inner.config.indexer_loss_coeff * cp
            )
        fully_shard(model, mesh=mesh)
    try:

        def loss_cp(ids: Any) -> torch.Tensor:
            if kind.startswith("reference"):  # handle.shard pads, and records the padding
                x = handle.shard(ids[0], 1, pad_value=0.0).requires_grad_()
                loss = (model(x) * handle.shard(ids[1], 1, pad_value=0.0)).sum()
                return loss * cp if fsdp else loss
            batch = handle.batch(ids)
            out = model(**batch.model_inputs(), use_cache=False)
            return cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)

        got_losses = _run_order(order, model, loss_cp, ids_a, ids_b)
        if fsdp:
            got_losses = [loss / cp for loss in got_losses]
        else:
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
        ref = want.get(n)
        got = p.grad.full_tensor() if fsdp and p.grad is not None else p.grad
        if ref is None and got is None:
            continue
        like = ref if ref is not None else got
        ref = torch.zeros_like(like) if ref is None else ref
        got = torch.zeros_like(like) if got is None else got
        floor = max(float(ref.abs().max()), 1e-2 * scale)
        errors[n] = float((got - ref).abs().max()) / floor
    worst = max(errors, key=errors.get)
    return {
        "kind": kind,
        "cp": cp,
        "layout": layout,
        "order": order,
        "reentrant": reentrant,
        "loss_err": max(abs(g - w) / abs(w) for g, w in zip(totals.tolist(), want_losses)),
        "grad_err": errors[worst],
        "worst": worst,
        "live_records": live,
    }


def unfindable_case(group: Any) -> str:
    """A recomputed region that hands the CP layer only a tensor made inside it, while two
    forwards are alive: every rank raises the same HpCpError, nothing is exchanged."""
    from torch.utils.checkpoint import checkpoint

    from hp_cp_core import HpCpError

    model = ReferenceStack()
    handle = enable_cp(model, group, CPConfig(single_rank_bypass=False))
    layer = model.layers[1]
    try:
        outs = []
        for seed in (1, 2):
            x = handle.shard(_stack_inputs(24, seed)[0], 1, pad_value=0.0).requires_grad_()
            outs.append(checkpoint(lambda h: layer(h * 1.0), x, use_reentrant=False).sum())
        try:
            outs[0].backward()
        except HpCpError as exc:
            return str(exc)
        return "no error"
    finally:
        disable_cp(handle)


def order_suite(rank: int, world: int, kinds: tuple[str, ...], cases: list[Any]) -> list[Any]:
    """Every ``(kind, cp, layout, order, reentrant)`` of ``cases`` on its sub-group (cp 2:
    ranks 0-1; cp 3: ranks 0-2); ranks outside a case's group skip it."""
    torch.set_num_threads(1)
    groups = {cp: dist.new_group(list(range(cp))) for cp in (2, 3) if cp <= world}
    out = []
    for kind, cp, layout, order, reentrant in cases:
        if kind not in kinds:
            continue
        if rank < cp:
            out.append(order_case(kind, groups[cp], layout, order, reentrant))
        dist.barrier()
    if "reference" in kinds:
        out.append({"unfindable": unfindable_case(groups[2]) if rank < 2 else None})
    return out
