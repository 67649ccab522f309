"""Rank functions of tests/megatron/test_megatron.py: megatron-core 0.19.2's ``GPTModel`` of MLA +
DSA layers (Megatron's own spec) under hp_cp, against the same model, weights and batch on one
process at ``context_parallel_size=1``, both through Megatron's ``forward_backward_func``.

One spawned job per cp size (Megatron's ``initialize_model_parallel`` needs the world to be a
multiple of the CP size): every rank computes the one-process references at cp 1 first, then
Megatron's parallel state is rebuilt at ``context_parallel_size = world`` and hp_cp runs on
Megatron's own CP group (Note [Megatron's CP group under hp_cp] in
``hp_cp_torch.integrations.megatron``).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_model import build_gpt_model, init_parallel, make_config  # noqa: E402
from megatron_shims import forward_backward_func_on_cpu, megatron_cpu_shims  # noqa: E402

SEQ = 61
"""A prime: a multiple of no cp and no 2 * cp, so every case pads (``handle.batch``)."""
CU = [0, 17, 18, 44, 61]
"""Packed documents (batch 1): one of a single token, none a multiple of anything."""
BATCH = 2
TOPK = 8
"""Far fewer than the up to 61 tokens a query sees: the indexer really selects."""
VOCAB = 128
LAYOUTS = ("contiguous", "load_balanced")
DOCS = ("padded", "packed")

VARIANTS = {
    "dense": {},
    "sparse": {"sparse_loss": True},
    "topk_freq2": {"topk_freq": 2},
    "per_token": {"calculate_per_token_loss": True},
    "megatron_kernel": {},
    "megatron_kernel_topk_freq2": {"topk_freq": 2},
}
"""Megatron configs: the dense indexer loss (Megatron's default), the sparse one, IndexShare
(layer 2 reuses layer 1's top-k) and ``calculate_per_token_loss``; all with
``dsa_indexer_loss_coeff=0.1``. The ``megatron_kernel`` variants run hp_cp with
``attention_kernel="megatron"`` (Megatron's own sparse attention on hp_cp's exchange)."""

EXTRA = {
    1: (
        ("sparse", "load_balanced", "packed"),
        ("topk_freq2", "contiguous", "padded"),
        ("megatron_kernel", "load_balanced", "packed"),
    ),
    2: (
        ("sparse", "load_balanced", "padded"),
        ("per_token", "contiguous", "packed"),
        ("megatron_kernel", "load_balanced", "padded"),
        ("megatron_kernel", "contiguous", "packed"),
    ),
    3: (
        ("topk_freq2", "load_balanced", "packed"),
        ("per_token", "load_balanced", "padded"),
        ("megatron_kernel_topk_freq2", "load_balanced", "packed"),
    ),
    4: (
        ("sparse", "contiguous", "packed"),
        ("topk_freq2", "load_balanced", "padded"),
        ("per_token", "load_balanced", "packed"),
        ("megatron_kernel", "load_balanced", "padded"),
    ),
}
"""Per cp, the cases beyond the dense loss at every layout x padded / packed."""


SEQ_B = 47
"""The length of the order cases' second forward (batch 1): another prime, another batch."""
ORDERS = ("fwd_fwd_bwd_bwd", "fwd_fwd_bwdB_bwdA", "fwd_eval_bwd")
"""The order cases' calls: forwards of A (S = 61, batch 2) and B (S = 47, batch 1), then the
backwards in both orders; or A's forward, an evaluation forward of B under ``torch.no_grad``,
then A's backward. Each with Megatron's full activation recomputation (:data:`RECOMPUTE`), so every
layer of A is re-run in A's backward, after B's forward."""
ORDER_CPS = (2, 3)
RECOMPUTE = {
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "selective": {
        "recompute_granularity": "selective",
        "recompute_modules": ["layernorm", "mla_up_proj", "core_attn", "mlp"],
    },
}
"""Megatron's activation recomputation: ``full``, each layer re-run in its backward
(``TransformerBlock`` through ``tensor_parallel.checkpoint``, its reentrant
``CheckpointFunction``); ``selective``, the modules that apply to an MLA layer (the input
layernorm, the attention's input, discarded after the attention's forward and recomputed in
its backward, ``CheckpointWithoutOutput``; the MLP; ``mla_up_proj`` and ``core_attn`` live
inside the forward hp_cp replaces, so under CP they recompute nothing)."""


def cases_for(cp: int) -> list[tuple[str, str, str]]:
    """``(variant, layout, docs)`` run at ``cp``."""
    plain = [("dense", layout, docs) for layout in LAYOUTS for docs in DOCS]
    return plain + list(EXTRA[cp])


def tokens(docs: str) -> torch.Tensor:
    batch = 1 if docs == "packed" else BATCH
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(7))


def one_process_batch(docs: str) -> dict[str, Any]:
    """The full batch as Megatron takes it on one process: labels ``tokens[t + 1]``, none at
    the last token (of each document when packed)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids = tokens(docs)
    labels = torch.zeros_like(ids)
    labels[:, :-1] = ids[:, 1:]
    mask = torch.ones(ids.shape, dtype=torch.float32)
    mask[:, -1] = 0
    psp = None
    if docs == "packed":
        mask[:, [c - 1 for c in CU[1:]]] = 0
        cu = torch.tensor(CU, dtype=torch.int32)
        longest = max(b - a for a, b in zip(CU[:-1], CU[1:]))
        psp = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
    labels = labels * mask.long()
    return {"tokens": ids, "labels": labels, "loss_mask": mask, "packed_seq_params": psp}


def loss_func(loss_mask, count, output_tensor):
    """``pretrain_gpt.py``'s ``loss_func`` shape: ``(loss, num_tokens, report)``; ``count`` maps
    (per-token losses, mask) to ``(loss, num_tokens)``."""
    loss, num_tokens = count(output_tensor, loss_mask)
    local = torch.sum(output_tensor.reshape(-1).float() * loss_mask.reshape(-1).float())
    report = {"lm loss": torch.stack([local.detach(), loss_mask.sum().float()])}
    return loss, num_tokens, report


def megatron_count(losses, loss_mask):
    """``pretrain_gpt.py``: this rank's sum and its target count."""
    mask = loss_mask.reshape(-1).float()
    return torch.sum(losses.reshape(-1).float() * mask), mask.sum().to(torch.int)


def tracker() -> dict:
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    return DSAIndexerLossLoggingHelper.tracker


def logged_indexer_loss(group: Any = None) -> torch.Tensor:
    """The indexer loss per layer Megatron's tracker holds, summed over ``group`` as its
    ``reduce_loss_in_tracker`` does with the reduce group (gloo has no AVG for the rest)."""
    values = tracker()["values"].clone()
    if group is not None and dist.get_world_size(group) > 1:
        assert tracker()["reduce_group"] is not None
        dist.all_reduce(values, group=group)
    return values


def run_fbf(model: Any, step_func: Any, micro_batch: int, seq: int) -> None:
    """One step of Megatron's ``forward_backward_func`` (no pipelining, one microbatch), with
    its one CUDA allocation (schedules.py:749) on the CPU (``forward_backward_func_on_cpu``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with forward_backward_func_on_cpu():
        get_forward_backward_func()(
            forward_step_func=step_func,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=micro_batch,
            forward_only=False,
        )


def finalize_on_cpu(group: Any, per_token: bool):
    """``config.finalize_model_grads_func`` emulating Megatron's DDP + ``finalize_model_grads``
    on CPU over ``group`` (data x context parallel; Megatron's DDP is CUDA-only): gradients
    times 1 / |group| summed (per-token loss: summed, then divided by the token count summed
    over the group)."""

    def finalize(models, num_tokens=None, **_: Any) -> None:
        size = 1 if group is None else dist.get_world_size(group)
        for model in models:
            for p in model.parameters():
                if p.grad is None:
                    continue
                if not per_token:
                    p.grad.mul_(1.0 / size)
                if size > 1:
                    dist.all_reduce(p.grad, group=group)
        if per_token:
            total = num_tokens.clone().float()
            if size > 1:
                dist.all_reduce(total, group=group)
            for model in models:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(total.clamp(min=1))

    return finalize


def config_for(variant: str, cp: int, recompute: str | None = None) -> Any:
    kwargs = dict(VARIANTS[variant])
    kwargs.update(RECOMPUTE.get(recompute, {}))
    per_token = kwargs.pop("calculate_per_token_loss", False)
    return make_config(
        context_parallel_size=cp,
        indexer_loss_coeff=0.1,
        calculate_per_token_loss=per_token,
        dsa_indexer_topk=TOPK,
        **kwargs,
    )


def reference(variant: str, docs: str) -> dict[str, Any]:
    """One process (Megatron at cp 1): logits, loss, every gradient after Megatron's step."""
    config = config_for(variant, 1)
    config.finalize_model_grads_func = finalize_on_cpu(None, config.calculate_per_token_loss)
    model = build_gpt_model(config, vocab_size=VOCAB)
    model.train()
    b = one_process_batch(docs)
    store = []

    def step(_it, m):
        out = m(
            b["tokens"],
            None,
            None,
            labels=b["labels"],
            packed_seq_params=b["packed_seq_params"],
        )
        return out, functools.partial(_reported, store, b["loss_mask"], megatron_count)

    tracker().clear()
    t0 = time.perf_counter()
    run_fbf(model, step, b["tokens"].shape[0], SEQ)
    seconds = time.perf_counter() - t0
    logged = logged_indexer_loss()
    report = store[-1]["lm loss"]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(b["tokens"], None, None, packed_seq_params=b["packed_seq_params"])
    return {
        "loss": float(report[0] / report[1]),
        "grads": grads,
        "logits": logits.detach(),
        "seconds": seconds,
        "indexer_loss": logged,
    }


def _reported(store: list, loss_mask: Any, count: Any, output_tensor: Any) -> tuple:
    """:func:`loss_func`, its report kept in ``store``."""
    result = loss_func(loss_mask, count, output_tensor)
    store.append(result[2])
    return result


def cp_case(
    rank: int, cp: int, variant: str, layout: str, docs: str, ref: dict[str, Any]
) -> dict[str, Any]:
    """The same step under hp_cp on Megatron's CP group (Megatron at ``context_parallel_size
    = cp``): handle.batch in place of ``get_batch_on_this_cp_rank``."""
    from megatron.core import parallel_state

    from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
    from hp_cp_torch.integrations.megatron import (
        megatron_labels,
        megatron_loss,
        packed_seq_params,
    )

    config = config_for(variant, cp)
    per_token = bool(config.calculate_per_token_loss)
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    config.finalize_model_grads_func = finalize_on_cpu(dp_cp, per_token)
    model = build_gpt_model(config, vocab_size=VOCAB)
    model.train()
    group = parallel_state.get_context_parallel_group()
    chunk = 5 if layout == "load_balanced" else DeepSeekV4CPConfig.query_chunk
    kernel = "megatron" if variant.startswith("megatron_kernel") else "banded"
    cfg = DeepSeekV4CPConfig(
        layout=layout, single_rank_bypass=False, query_chunk=chunk, attention_kernel=kernel
    )
    handle = enable_cp(model, group, cfg)
    calls = _count_megatron_kernel_calls()
    try:
        ids = tokens(docs)
        batch = handle.batch(ids, cu_seqlens=CU if docs == "packed" else None)
        labels, mask = megatron_labels(batch)
        psp = packed_seq_params(batch)
        store: list = []

        def count(losses, loss_mask):
            return megatron_loss(losses, loss_mask, batch, cp, per_token)

        def step(_it, m):
            out = m(batch.input_ids, batch.position_ids, None, labels=labels, packed_seq_params=psp)
            return out, functools.partial(_reported, store, mask, count)

        tracker().clear()
        t0 = time.perf_counter()
        run_fbf(model, step, ids.shape[0], batch.input_ids.shape[1])
        seconds = time.perf_counter() - t0
        logged = logged_indexer_loss(group)
        stats = handle.stats()
        with torch.no_grad():
            logits = model(batch.input_ids, batch.position_ids, None, packed_seq_params=psp)
            logits = handle.unshard(logits.detach(), 1, rows=SEQ)
        report = store[-1]["lm loss"].clone()
        dist.all_reduce(report, group=group)
    finally:
        disable_cp(handle)
        calls.restore()
    largest = max(float(g.abs().max()) for g in ref["grads"].values())
    grad_err = {}
    for n, p in model.named_parameters():
        want = ref["grads"][n]
        got = torch.zeros_like(want) if p.grad is None else p.grad
        scale = max(float(want.abs().max()), 1e-2 * largest)
        grad_err[n] = float((got - want).abs().max()) / scale
    worst = max(grad_err, key=grad_err.get)
    indexer = [n for n in grad_err if ".indexer." in n]
    ref_logits = ref["logits"]
    loss = float(report[0] / report[1])
    return {
        "cp": cp,
        "variant": variant,
        "layout": layout,
        "docs": docs,
        "loss_abs_err": abs(loss - ref["loss"]),
        "indexer_loss": ref["indexer_loss"].tolist(),
        "indexer_loss_abs_err": float((logged - ref["indexer_loss"]).abs().max()),
        "loss": loss,
        "logits_abs_err": float((logits - ref_logits).abs().max()),
        "logits_scale": float(ref_logits.abs().max()),
        "grad_rel_err_max": grad_err[worst],
        "grad_rel_err_worst_param": worst,
        "indexer_grad_rel_err_max": max(grad_err[n] for n in indexer),
        "indexer_params": len(indexer),
        "indexer_grad_norm": sum(float(ref["grads"][n].norm()) for n in indexer),
        "params": len(grad_err),
        "bytes_sent": stats["bytes_sent"],
        "megatron_kernel_calls": calls.count,
        "time_cp_s": seconds,
        "time_single_s": ref["seconds"],
    }


class _count_megatron_kernel_calls:  # noqa: N801 - used as a context value
    """Counts the calls of Megatron's ``dsa._run_sparse_attention`` until :meth:`restore`
    (``attention_kernel="megatron"`` calls it once per query chunk; hp_cp's kernels never)."""

    def __init__(self) -> None:
        from megatron.core.transformer.experimental_attention_variant import dsa

        self.dsa, self.real, self.count = dsa, dsa._run_sparse_attention, 0

        def counting(**kwargs: Any) -> Any:
            self.count += 1
            return self.real(**kwargs)

        dsa._run_sparse_attention = counting

    def restore(self) -> None:
        self.dsa._run_sparse_attention = self.real


def error_cases(rank: int, cp: int) -> dict[str, str]:
    """Refused on every rank before any exchange: a Megatron CP group that is not hp_cp's
    (Megatron at context_parallel_size 1 beside an hp_cp group of ``cp``), an attention mask,
    a batch sharded by Megatron's ``get_batch_on_this_cp_rank``."""
    from megatron.core import parallel_state

    from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp, enable_cp

    out: dict[str, str] = {}

    def expect(fn, match: str) -> str:
        try:
            fn()
        except HpCpError as exc:
            return "ok" if match in str(exc) else f"wrong message: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    init_parallel(1)
    model = build_gpt_model(config_for("dense", 1), vocab_size=VOCAB)
    cfg = DeepSeekV4CPConfig(single_rank_bypass=False)
    out["megatron_cp_1"] = expect(
        lambda: enable_cp(model, dist.group.WORLD, cfg), "context_parallel_size=1)"
    )
    init_parallel(cp)
    model = build_gpt_model(config_for("dense", cp), vocab_size=VOCAB)
    handle = enable_cp(model, parallel_state.get_context_parallel_group(), cfg)
    try:
        batch = handle.batch(tokens("padded"))
        mask = torch.ones(1, 1, batch.input_ids.shape[1], batch.input_ids.shape[1]).bool()
        with torch.no_grad():
            out["attention_mask"] = expect(
                lambda: model(batch.input_ids, batch.position_ids, mask), "attention_mask=None"
            )
        # a batch Megatron shards itself (zigzag) is refused, not roped at the wrong rows
        from megatron.core.utils import get_batch_on_this_cp_rank

        ids = torch.randint(0, VOCAB, (1, 4 * cp), generator=torch.Generator().manual_seed(3))
        full = {"tokens": ids, "position_ids": torch.arange(4 * cp)[None]}
        local = get_batch_on_this_cp_rank(
            full, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
        )
        with torch.no_grad():
            out["megatron_sharded_batch"] = expect(
                lambda: model(local["tokens"], local["position_ids"], None),
                "get_batch_on_this_cp_rank",
            )
    finally:
        disable_cp(handle)
    return out


def megatron_suite(rank: int, world: int) -> dict[str, Any]:
    """Every case of cp = ``world``: references at cp 1, then hp_cp at cp ``world``."""
    torch.set_num_threads(1)
    cases = cases_for(world)
    results: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    order_results: list[dict[str, Any]] = []
    with megatron_cpu_shims():
        init_parallel(1)
        refs = {(v, d): reference(v, d) for v, d in sorted({(v, d) for v, _l, d in cases})}
        orders = order_cases_for(world)
        order_refs = {
            (o, r): order_reference(o, r) for o, r in sorted({(o, r) for o, _, r in orders})
        }
        init_parallel(world)
        for variant, layout, docs in cases:
            results.append(cp_case(rank, world, variant, layout, docs, refs[(variant, docs)]))
        for order, layout, recompute in orders:
            ref = order_refs[(order, recompute)]
            order_results.append(order_case(rank, world, order, layout, recompute, ref))
        if world == 2:
            errors = error_cases(rank, world)
    return {"results": results, "errors": errors, "orders": order_results}


# ---------------------------------------------------------------------- forwards and backwards
def order_cases_for(cp: int) -> list[tuple[str, str, str]]:
    """``(order, layout, recompute)`` of the order cases run at ``cp``: Megatron's full
    recomputation in every order and layout, its selective one in the first order and one
    layout, torch's non-reentrant ``checkpoint_wrapper`` in the second order and that layout."""
    if cp not in ORDER_CPS:
        return []
    full = [(o, layout, "full") for o in ORDERS for layout in LAYOUTS]
    torch_ = [(ORDERS[1], LAYOUTS[cp % 2], "torch_non_reentrant")]
    return [*full, (ORDERS[0], LAYOUTS[cp % 2], "selective"), *torch_]


def order_tokens(which: str) -> torch.Tensor:
    """Batch A (``[BATCH, SEQ]``) or B (``[1, SEQ_B]``), padded documents."""
    shape, seed = ((BATCH, SEQ), 7) if which == "A" else ((1, SEQ_B), 11)
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def run_order(order: str, model: Any, forward: Any, snapshot: Any) -> dict[str, Any]:
    """The calls of ``order``: ``forward(which)`` is ``(loss to backward, global mean)``,
    ``snapshot()`` the gradients (all ranks' reduction) after each backward."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossAutoScaler,
    )

    losses, grads = {}, []
    model.train()
    loss_a, losses["A"] = forward("A")
    if order == "fwd_eval_bwd":
        model.eval()
        with torch.no_grad():
            losses["B eval"] = forward("B")[1]
        model.train()
        backwards = [loss_a]
    else:
        loss_b, losses["B"] = forward("B")
        backwards = [loss_a, loss_b] if order == "fwd_fwd_bwd_bwd" else [loss_b, loss_a]
    for loss in backwards:
        loss.backward()
        grads.append(snapshot())
    DSAIndexerLossAutoScaler.set_loss_scale(torch.ones(()))
    return {"losses": losses, "grads": grads}


def build_order_model(cp: int, recompute: str) -> Any:
    """The order cases' model: Megatron's recomputation ``recompute``, or (``torch_reentrant``,
    ``torch_non_reentrant``) each ``TransformerLayer`` in torch's ``checkpoint_wrapper``."""
    if not recompute.startswith("torch_"):
        return build_gpt_model(config_for("dense", cp, recompute), vocab_size=VOCAB)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    model = build_gpt_model(config_for("dense", cp), vocab_size=VOCAB)
    impl = (
        CheckpointImpl.REENTRANT if recompute == "torch_reentrant" else CheckpointImpl.NO_REENTRANT
    )
    layers = model.decoder.layers
    for k, layer in enumerate(layers):
        layers[k] = checkpoint_wrapper(layer, checkpoint_impl=impl)
    return model


def order_reference(order: str, recompute: str) -> dict[str, Any]:
    """One process (Megatron at cp 1, the same recomputation) running the calls of ``order``."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossAutoScaler,
    )

    model = build_order_model(1, recompute)
    DSAIndexerLossAutoScaler.set_loss_scale(torch.ones(()))

    def forward(which: str) -> tuple[torch.Tensor, float]:
        ids = order_tokens(which)
        labels = torch.zeros_like(ids)
        labels[:, :-1] = ids[:, 1:]
        mask = torch.ones(ids.shape)
        mask[:, -1] = 0
        out = model(ids, None, None, labels=labels)
        loss = torch.sum(out.float() * mask) / mask.sum()
        return loss, float(loss)

    def snapshot() -> dict[str, torch.Tensor]:
        return {
            n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()
        }

    tracker().clear()
    return run_order(order, model, forward, snapshot)


def order_case(
    rank: int, cp: int, order: str, layout: str, recompute: str, ref: dict[str, Any]
) -> dict[str, Any]:
    """The calls of ``order`` under hp_cp on Megatron's CP group, with Megatron's
    recomputation ``recompute``; the errors against :func:`order_reference` (or the error
    raised)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossAutoScaler,
    )

    from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
    from hp_cp_torch.integrations.megatron import megatron_labels, megatron_loss

    model = build_order_model(cp, recompute)
    group = parallel_state.get_context_parallel_group()
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    chunk = 5 if layout == "load_balanced" else DeepSeekV4CPConfig.query_chunk
    cfg = DeepSeekV4CPConfig(layout=layout, single_rank_bypass=False, query_chunk=chunk)
    handle = enable_cp(model, group, cfg)
    # the schedule's scale of the indexer loss (cp / microbatches), undone by DDP's average
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(float(cp)))

    def forward(which: str) -> tuple[torch.Tensor, float]:
        batch = handle.batch(order_tokens(which))
        labels, mask = megatron_labels(batch)
        out = model(batch.input_ids, batch.position_ids, None, labels=labels)
        loss, _ = megatron_loss(out, mask, batch, cp, per_token=False)
        report = torch.stack([torch.sum(out.detach().float() * mask), mask.sum()])
        dist.all_reduce(report, group=group)
        return loss, float(report[0] / report[1])

    def snapshot() -> dict[str, torch.Tensor]:
        out = {}
        for n, p in model.named_parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            dist.all_reduce(g, group=dp_cp)
            out[n] = g / dist.get_world_size(dp_cp)
        return out

    tracker().clear()
    result: dict[str, Any] = {"cp": cp, "order": order, "layout": layout, "recompute": recompute}
    try:
        got = run_order(order, model, forward, snapshot)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        return result
    finally:
        disable_cp(handle)
    result["loss_rel_err"] = max(
        abs(got["losses"][k] - v) / abs(v) for k, v in ref["losses"].items()
    )
    result["losses"] = sorted(got["losses"])
    worst, where = 0.0, ""
    for step, (mine, want) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        largest = max(float(g.abs().max()) for g in want.values())
        for n, w in want.items():
            err = float((mine[n] - w).abs().max()) / max(float(w.abs().max()), 1e-2 * largest)
            if err >= worst:
                worst, where = err, f"backward {step + 1}: {n}"
    result["grad_rel_err_max"], result["grad_rel_err_worst"] = worst, where
    result["backwards"] = len(got["grads"])
    return result
