"""Megatron's own all-gather DSA context parallelism against one process, on CPU (gloo).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tests/megatron/megatron_own_cp_check.py \
        [--seq 64] [--batch 2] [--coeff 0.1] [--sparse-loss] [--show-errors]

One forward + backward of the MLA + DSA ``GPTModel`` (``megatron_model.py``) with Megatron's loss,
twice, with the same weights and batch:

1. **one process**: rank 0 alone, ``context_parallel_size=1``, the whole batch;
2. **Megatron's CP**: both ranks, ``context_parallel_size=2``, the batch sharded by
   ``megatron.core.utils.get_batch_on_this_cp_rank`` (zigzag), ``cp_comm_type="allgather"``.

Both run Megatron's schedule step, ``megatron.core.pipeline_parallel.schedules.forward_step``
(which applies ``forward_step_calc_loss``: the loss normalisation and the indexer-loss scale
``DSAIndexerLossAutoScaler.set_loss_scale(loss_scale * cp / num_microbatches)``) and
``schedules.backward_step``, with ``pretrain_gpt.py``'s ``loss_func`` (sum of masked per-token
losses, token count). ``forward_backward_func`` itself is tried first and reported: as installed
it does not run on CPU (``schedules.py:749``); at cp 2 it is run again with that one line
redirected (``megatron_shims.forward_backward_func_on_cpu``) and its gradients compared with the
``forward_step`` + ``backward_step`` ones. Megatron's DDP is CUDA-only (its grad buffers
live on ``torch.cuda.current_device()``), so its gradient reduction is emulated exactly as it is
configured by default: sum over the dp x cp group times ``gradient_scaling_factor = 1 /
dp_cp_size`` (``distributed/distributed_data_parallel.py:210-212``).

Printed: the max errors of the loss, the logits and every named parameter gradient (relative to
the largest one-process gradient), the ratio of the CP indexer gradients to the one-process
ones, the indexer loss Megatron logs (its tracker) in both runs, and a finite-difference check,
on one process, that the one-process indexer gradient is the gradient of the logged indexer loss.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_model import build_gpt_model, init_parallel, make_batch, make_config  # noqa: E402
from megatron_shims import (  # noqa: E402
    REDIRECTED,
    SHIMS,
    forward_backward_func_on_cpu,
    megatron_cpu_shims,
)

INDEXER = ".core_attention.indexer."


def megatron_loss_func(loss_mask, output_tensor):
    """``pretrain_gpt.py``'s ``loss_func`` (without ModelOpt and the NaN / spike checks)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step_func(data_iterator, model):
    """``pretrain_gpt.py``'s ``forward_step`` with the batch already on this CP rank."""
    b = next(data_iterator)
    out = model(
        b["tokens"],
        b["position_ids"],
        b["attention_mask"],
        labels=b["labels"],
        loss_mask=b["loss_mask"],
    )
    return out, functools.partial(megatron_loss_func, b["loss_mask"])


def tracker_values() -> torch.Tensor | None:
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    return None if values is None else values.detach().clone()


def clean_tracker() -> None:
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    DSAIndexerLossLoggingHelper.tracker.clear()


def megatron_step(model, batch, config, cp_size: int) -> tuple[torch.Tensor, dict]:
    """Megatron's ``forward_step`` + ``backward_step`` for one microbatch; returns the scaled
    loss tensor that was back-propagated and the loss report."""
    from megatron.core.pipeline_parallel import schedules

    store: list = []
    output, _num_tokens = schedules.forward_step(
        forward_step_func,
        iter([batch]),
        model,
        1,
        None,
        store,
        config,
        cp_size,
        is_first_microbatch=True,
        current_microbatch=0,
        is_last_stage=True,
    )
    schedules.backward_step(None, output, None, config)
    return output.detach(), store[0]


def try_forward_backward_func(model, batch, seq: int, step_grads=None) -> str:
    """Run ``get_forward_backward_func()`` (no pipelining) once; return what happened. With
    ``step_grads`` (the gradients of ``megatron_step`` on the same model and batch), run it
    under ``forward_backward_func_on_cpu`` and compare its gradients with them."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fbf = get_forward_backward_func()
    model.zero_grad(set_to_none=True)
    clean_tracker()
    try:
        with forward_backward_func_on_cpu() if step_grads else _nothing():
            fbf(
                forward_step_func=forward_step_func,
                data_iterator=iter([batch]),
                model=[model],
                num_microbatches=1,
                seq_length=seq,
                micro_batch_size=batch["tokens"].size(0),
                forward_only=False,
            )
        if step_grads:
            diff = max(
                float((p.grad - step_grads[n]).abs().max()) for n, p in model.named_parameters()
            )
            return (
                f"{fbf.__name__} ran with schedules.py:749 redirected; "
                f"max |grad - forward_step/backward_step grad| {diff:.3e}"
            )
    except Exception as exc:  # noqa: BLE001
        return f"{fbf.__name__} raised {type(exc).__name__}: {exc} at {megatron_frame(exc)}"
    finally:
        model.zero_grad(set_to_none=True)
        clean_tracker()
    return f"{fbf.__name__} ran"


@contextlib.contextmanager
def _nothing():
    yield


def megatron_frame(exc: BaseException) -> str:
    """The innermost megatron (else innermost) frame of ``exc``'s traceback, ``file:line``."""
    frames = traceback.extract_tb(exc.__traceback__)
    mega = [f for f in frames if "site-packages/megatron/" in f.filename] or frames
    f = mega[-1]
    path = f.filename.split("site-packages/")[-1]
    return f"{path}:{f.lineno} ({f.line})"


def unzigzag(local: torch.Tensor, cp: int, group) -> torch.Tensor:
    """Gather [B, S/cp, ...] zigzag shards from every CP rank into [B, S, ...] in order."""
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    chunks = [None] * (2 * cp)
    for r, part in enumerate(parts):
        a, b = part.chunk(2, dim=1)
        chunks[r], chunks[2 * cp - 1 - r] = a, b
    return torch.cat(chunks, dim=1)


def finite_difference_indexer(model, batch, layer: int, grads: dict, eps: float) -> tuple:
    """d/de of the logged indexer loss of ``layer`` along the unit direction of the one-process
    gradient of that layer's indexer parameters, against the gradient's norm."""
    prefix = f"decoder.layers.{layer}.self_attention{INDEXER}"
    params = {n: p for n, p in model.named_parameters() if n.startswith(prefix)}
    g = torch.cat([grads[n].flatten() for n in params])
    norm = g.norm()
    direction = {n: grads[n] / norm for n in params}

    from megatron.core.transformer.experimental_attention_variant import dsa

    naive = dsa.fused_qk_topk_naive
    topks: dict[float, list] = {}

    def logged(sign: float) -> float:
        calls = topks.setdefault(sign, [])

        def recording(*a, **k):
            scores, topk = naive(*a, **k)
            calls.append(topk.clone())
            return scores, topk

        with torch.no_grad():
            for n, p in params.items():
                p.add_(sign * eps * direction[n])
        clean_tracker()
        dsa.fused_qk_topk_naive = recording
        try:
            model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        finally:
            dsa.fused_qk_topk_naive = naive
        value = float(tracker_values()[layer])
        with torch.no_grad():
            for n, p in params.items():
                p.sub_(sign * eps * direction[n])
        return value

    fd = (logged(+1.0) - logged(-1.0)) / (2 * eps)
    # the layer's top-k sets (as sets per row) at +eps and -eps
    plus, minus = topks[1.0][layer], topks[-1.0][layer]
    differ = (plus.sort(-1).values != minus.sort(-1).values).any(-1)
    return fd, float(norm), f"{int(differ.sum())} of {differ.numel()} rows differ"


def run(args, skip: tuple[str, ...] = ()) -> None:
    rank = dist.get_rank()
    cp = dist.get_world_size()
    config_kwargs = dict(
        indexer_loss_coeff=args.coeff,
        sparse_loss=args.sparse_loss,
        topk_freq=args.topk_freq,
        dsa_indexer_scoring_relu=not args.no_relu,
        rope_type=args.rope_type,
    )
    full = make_batch(args.batch, args.seq)

    # ---- 1. one process: rank 0 alone at cp 1 ----
    init_parallel(1)
    ref = {}
    if rank == 0 and not skip:
        with megatron_cpu_shims():
            config = make_config(context_parallel_size=1, **config_kwargs)
            model = build_gpt_model(config, seed=args.seed)
            ref["fbf"] = try_forward_backward_func(model, full, args.seq)
            clean_tracker()
            ref["out"], ref["report"] = megatron_step(model, full, config, 1)
            ref["tracker"] = tracker_values()
            ref["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                ref["logits"] = model(full["tokens"], full["position_ids"], None)
            ref["fd"] = finite_difference_indexer(model, full, 0, ref["grads"], args.fd_eps)
            del model
    dist.barrier()

    # ---- 2. Megatron's own CP at cp = world size ----
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    init_parallel(cp)
    cp_group = parallel_state.get_context_parallel_group()
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    local = get_batch_on_this_cp_rank(
        {k: (None if v is None else v.clone()) for k, v in full.items()},
        is_hybrid_cp=False,
        cp_group=cp_group,
    )
    with megatron_cpu_shims(skip=skip):
        config = make_config(context_parallel_size=cp, **config_kwargs)
        model = build_gpt_model(config, seed=args.seed)
        clean_tracker()
        _out, report = megatron_step(model, local, config, cp)
        tracker = tracker_values()
        with torch.no_grad():
            logits = model(local["tokens"], local["position_ids"], None)
    if skip:
        return
    raw = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with megatron_cpu_shims():
        fbf_cp = try_forward_backward_func(model, local, args.seq // cp, step_grads=raw)
    # DDP's default reduction: grads * (1 / dp_cp_size), summed over dp x cp.
    dp_cp = dist.get_world_size(dp_cp_group)
    grads = {}
    for n, p in model.named_parameters():
        g = raw[n] * (1.0 / dp_cp)
        dist.all_reduce(g, group=dp_cp_group)
        grads[n] = g
    lm = report["lm loss"].clone()
    dist.all_reduce(lm, group=cp_group)
    # The tracker as DSAIndexerLossLoggingHelper.reduce_loss_in_tracker reduces it at cp > 1
    # without per-token loss: AVG over cp (gloo has no AVG: sum / cp).
    dist.all_reduce(tracker, group=cp_group)
    tracker /= cp
    logits_full = unzigzag(logits, cp, cp_group)

    if rank != 0:
        return
    ref_loss = float(ref["report"]["lm loss"][0] / ref["report"]["lm loss"][1])
    cp_loss = float(lm[0] / lm[1])
    print(f"forward_backward_func on CPU, as installed: {ref['fbf']}")
    print(f"forward_backward_func at cp {cp} (rank 0): {fbf_cp}")
    print(
        f"S={args.seq} B={args.batch} topk={config.dsa_indexer_topk} cp={cp} "
        f"indexer_loss_coeff={args.coeff} sparse_loss={args.sparse_loss} "
        f"topk_freq={args.topk_freq}; top-k selects in "
        f"{max(args.seq - config.dsa_indexer_topk, 0)} of {args.seq} query rows per sequence"
    )
    print(
        f"loss: one process {ref_loss:.8f}  megatron cp {cp_loss:.8f}  "
        f"|diff| {abs(ref_loss - cp_loss):.3e}"
    )
    print(
        f"logits: max |diff| {float((logits_full - ref['logits']).abs().max()):.3e}  "
        f"(max |logit| {float(ref['logits'].abs().max()):.3e})"
    )
    floor = max(float(g.abs().max()) for g in ref["grads"].values())
    print(f"gradients (max |cp - one| / {floor:.3e}, the largest one-process gradient):")
    worst_main = worst_idx = worst_idx_over_cp = 0.0
    for n, g_ref in ref["grads"].items():
        g = grads[n]
        err = float((g - g_ref).abs().max()) / floor
        line = f"  {n:72s} {err:.3e}"
        if INDEXER in n:
            ratio = float((g * g_ref).sum() / (g_ref * g_ref).sum().clamp_min(1e-30))
            err_cp = float((g / cp - g_ref).abs().max()) / floor
            worst_idx = max(worst_idx, err)
            worst_idx_over_cp = max(worst_idx_over_cp, err_cp)
            line += f"  ratio cp/one {ratio:.6f}  |cp/{cp} - one| {err_cp:.3e}"
        else:
            worst_main = max(worst_main, err)
        print(line)
    print(f"max gradient error, non-indexer parameters: {worst_main:.3e}")
    print(
        f"max gradient error, indexer parameters: {worst_idx:.3e}; "
        f"after dividing the cp gradients by {cp}: {worst_idx_over_cp:.3e}"
    )
    print(
        "logged indexer loss per layer (coeff x KL mean), one process: "
        f"{ref['tracker'].tolist()}  megatron cp (avg over cp): {tracker.tolist()}"
    )
    print(f"torch.cuda.current_device() calls answered 'cpu' by the shim: {dict(REDIRECTED)}")
    fd, norm, same_topk = ref["fd"]
    print(
        f"one process, layer 0 indexer: finite-difference d(logged indexer loss) along the "
        f"gradient direction {fd:.7e} vs |one-process gradient| {norm:.7e} "
        f"(relative diff {abs(fd - norm) / norm:.2e}; megatron cp applies {cp} x = "
        f"{cp * norm:.7e}); layer-0 top-k sets at +eps vs -eps: {same_topk}"
    )


def show_errors(args) -> None:
    """Megatron's CP step with each shim left out in turn: what fails, where."""
    rank = dist.get_rank()
    for name in SHIMS:
        clean_tracker()
        try:
            run(args, skip=(name,))
            msg = "ran"
        except Exception as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]} at {megatron_frame(exc)}"
        if rank == 0:
            print(f"cp={dist.get_world_size()} without {name}: {msg}", flush=True)
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--coeff", type=float, default=0.1)
    parser.add_argument("--sparse-loss", action="store_true")
    parser.add_argument("--topk-freq", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--fd-eps", type=float, default=1e-3)
    parser.add_argument("--no-relu", action="store_true", help="dsa_indexer_scoring_relu=False")
    parser.add_argument("--rope-type", choices=("rope", "yarn"), default="rope")
    parser.add_argument("--show-errors", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if args.seq % (2 * dist.get_world_size()):
        raise SystemExit("--seq must be a multiple of 2 x cp (Megatron's zigzag)")
    if args.show_errors:
        show_errors(args)
    else:
        run(args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
