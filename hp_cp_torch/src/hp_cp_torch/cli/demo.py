"""``hp-cp demo``: a parity report of CP against one device, on N local gloo ranks (CPU).

Every rank builds the same small stack of reference layers (r = 0, 4, 128) from one seed,
runs it on the whole sequence (single device) and on its own rows under CP, forward and
backward, and reports per layer the max relative error of outputs and gradients, the bytes
it moved and its step time. Exit status 1 on a parity failure.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from hp_cp_core import CPConfig, disable_cp, enable_cp

OUT_TOL = 1e-5
GRAD_TOL = 1e-4
RATIOS = (0, 4, 128)


class ReferenceStack(nn.Module):
    """Residual stack of reference attention layers, one per compress ratio."""

    def __init__(self, hidden: int, window: int, topk: int) -> None:
        super().__init__()
        from hp_cp_torch.reference import DeepSeekV4Attention, DeepSeekV4AttentionConfig

        self.layers = nn.ModuleList(
            DeepSeekV4Attention(
                DeepSeekV4AttentionConfig(
                    hidden_size=hidden, compress_ratio=r, window_size=window, index_topk=topk
                )
            )
            for r in RATIOS
        )

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> list:
        outs = []
        for layer in self.layers:
            x = x + layer(x, position_ids=position_ids)
            outs.append(x)
        return outs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def reference_parity(
    rank: int, world: int, layout: str, seq_len: int, batch: int, device: str = "cpu"
) -> dict:
    """Run on every rank: single-device vs CP for the reference stack."""
    torch.manual_seed(0)
    model = ReferenceStack(hidden=64, window=32, topk=8).to(device)
    x = torch.randn(batch, seq_len, 64).to(device)
    pos = torch.arange(seq_len, device=device)
    grad_out = torch.randn(batch, seq_len, 64).to(device)

    t0 = time.perf_counter()
    x1 = x.clone().requires_grad_(True)
    ref_outs = model(x1, pos)
    ref_outs[-1].backward(grad_out)
    single_s = time.perf_counter() - t0
    ref_grads = [
        [p.grad.clone() for p in layer.parameters() if p.grad is not None] for layer in model.layers
    ]
    ref_xgrad = x1.grad.clone()
    ref_index_loss = float(model.layers[RATIOS.index(4)].indexer_loss)
    model.zero_grad()

    handle = enable_cp(model, None, CPConfig(layout=layout))
    t0 = time.perf_counter()
    xl = handle.shard(x, 1).requires_grad_(True)
    outs = model(xl, handle.shard(pos, 0))
    outs[-1].backward(handle.shard(grad_out, 1))
    cp_s = time.perf_counter() - t0
    index_loss = float(model.layers[RATIOS.index(4)].indexer_loss)  # global mean, every rank
    stats = handle.stats()  # this layer stack's traffic, before the report's unshards
    rows: list[dict[str, Any]] = []
    for i, (layer, out, ref) in enumerate(zip(model.layers, outs, ref_outs)):
        full = handle.unshard(out.detach(), 1)
        grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        for g in grads:
            torch.distributed.all_reduce(g)
        gerr = max((_rel(a, b) for a, b in zip(grads, ref_grads[i])), default=0.0)
        rows.append(
            {"layer": i, "ratio": RATIOS[i], "out_err": _rel(full, ref.detach()), "grad_err": gerr}
        )
    xerr = _rel(handle.unshard(xl.grad, 1), ref_xgrad)
    disable_cp(handle)
    return {
        "rows": rows,
        "x_grad_err": xerr,
        "indexer_loss_err": abs(index_loss - ref_index_loss) / max(abs(ref_index_loss), 1e-30),
        "summary": [
            ("input grad err", "x_grad_err", GRAD_TOL),
            ("indexer KL loss err", "indexer_loss_err", OUT_TOL),
        ],
        "bytes_sent": stats["bytes_sent"],
        "bytes_recv": stats["bytes_recv"],
        "single_s": single_s,
        "cp_s": cp_s,
    }


def report(results: list[dict], title: str) -> bool:
    """Print the per-layer table; True when every error is within tolerance."""
    print(title)
    print(f"{'layer':<7}{'kind':<30}{'max out err':<14}{'max grad err':<14}")
    ok = True
    first = results[0]
    for i, row in enumerate(first["rows"]):
        out_err = max(r["rows"][i]["out_err"] for r in results)
        grad_err = max(r["rows"][i]["grad_err"] for r in results)
        ok &= out_err <= OUT_TOL and grad_err <= GRAD_TOL
        name = row.get("name", row.get("layer"))
        print(f"{name!s:<7}{row.get('ratio', '-')!s:<30}{out_err:<14.3e}{grad_err:<14.3e}")
    for label, key, tol in first.get("summary", [("input grad err", "x_grad_err", GRAD_TOL)]):
        err = max(r[key] for r in results)
        ok &= err <= tol
        print(f"{label} {err:.3e}")
    print(f"{'rank':<6}{'bytes sent':<14}{'bytes recv':<14}{'cp step s':<12}{'plain 1-dev s':<14}")
    for k, r in enumerate(results):
        print(
            f"{k:<6}{r['bytes_sent']:<14}{r['bytes_recv']:<14}{r['cp_s']:<12.3f}"
            f"{r['single_s']:<12.3f}"
        )
    print(
        "(step times: one run each, the plain layers on one device first, then the CP path: "
        "not a scaling measure; `hp-cp bench` reports step_time_cp2_over_cp1)"
    )
    print("PARITY OK" if ok else f"PARITY FAILED (tolerance out {OUT_TOL}, grad {GRAD_TOL})")
    return ok


def torchrun_main(layout: str = "contiguous", seq_len: int | None = None) -> int:
    """The same report when launched by ``torchrun`` (NCCL on GPUs, gloo otherwise)."""
    import os

    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = seq_len or 128 * 2 * world
    device = f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu"
    result = reference_parity(rank, world, layout, n, 2, device)
    results: list[Any] = [None] * world
    dist.all_gather_object(results, result)
    ok = rank != 0 or report(results, f"reference layers, cp={world}, {layout}, S={n} ({device})")
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if int(flag) else 1


def _transformers_rows(result: dict) -> dict:
    """The transformers demo's per-rank report in this module's table format."""
    per_layer = result["grad_rel_err_per_layer"]
    rows = []
    for name, err in result["attn_out_rel_err"].items():
        layer, kind = name.split(":", 1)  # "layer0:sliding_attention"
        rows.append(
            {"name": layer, "ratio": kind, "out_err": err, "grad_err": per_layer.get(layer, 0.0)}
        )
    return {
        **result,
        "rows": rows,
        "summary": [
            ("logits rel err", "logits_rel_err", OUT_TOL),
            ("loss rel err", "loss_rel_err", OUT_TOL),
            (
                f"worst param grad rel err ({result['grad_rel_err_worst_param']})",
                "grad_rel_err_max",
                GRAD_TOL,
            ),
        ],
        "cp_s": result["time_cp_fwd_bwd_s"],
        "single_s": result["time_single_s"],
    }


def main(
    cp: int,
    model: str = "reference",
    layout: str = "contiguous",
    seq_len: int | None = None,
    launcher: str = "local",
) -> int:
    from hp_cp_torch.cli.launch import run_ranks

    if launcher == "torchrun":
        return torchrun_main(layout, seq_len)

    if model == "transformers":
        from hp_cp_torch.cli.parity import run_parity

        lengths = () if seq_len is None else (seq_len,)
        results = [_transformers_rows(r) for r in run_ranks(cp, run_parity, layout, *lengths)]
        return 0 if report(results, f"transformers DeepseekV4ForCausalLM, cp={cp}, {layout}") else 1
    n = seq_len or 128 * 2 * cp
    results = run_ranks(cp, reference_parity, layout, n, 2)
    title = f"reference layers r={RATIOS}, cp={cp}, {layout}, B=2, S={n} (gloo, CPU)"
    return 0 if report(results, title) else 1
