"""Rank functions of tests/nemo_automodel (spawned processes need module-level functions).

The model is NeMo Automodel's own ``DeepseekV4ForCausalLM`` (tiny: a sliding-window, a CSA
r = 4 and an HCA r = 128 layer, MoE on its single-process expert path, hyper-connections),
fp32 on CPU. Every CP result is compared, in the same job, with the same model and weights
run on one process.
"""

from __future__ import annotations

import copy
import os
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo's fp32 RMSNorm is a compiled op

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_cp_core import DeepSeekV4CPConfig, HpCpError
from hp_cp_torch.integrations.nemo_automodel import (
    cp_causal_lm_loss,
    cp_sum_gradients,
    disable_cp,
    enable_cp,
    nemo_cp_batch,
)

VOCAB = 64


def build_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """NeMo's DeepseekV4ForCausalLM, tiny, fp32, layers [sliding, CSA r=4, HCA r=128]."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
    from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        qk_rope_head_dim=8,
        q_lora_rank=16,
        o_lora_rank=8,
        o_groups=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        compress_ratios=[0, 4, 128],
        sliding_window=16,
        num_hash_layers=0,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        index_head_dim=8,
        index_n_heads=8,
        index_topk=8,
        num_nextn_predict_layers=0,
        torch_dtype="float32",
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kw), backend=BackendConfig(attn="sdpa"))
    model.initialize_weights(buffer_device=torch.device("cpu"))
    with torch.no_grad():  # non-zero sinks and compressor position biases
        for name, p in model.named_parameters():
            if name.endswith(("sinks_param.weight", "ape_param.weight")):
                p.normal_(0.0, 0.5)
    return model.float().train()


def make_ids(seq_len: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq_len), generator=g)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def reference(model: torch.nn.Module, ids: torch.Tensor, cu: list[int] | None = None) -> dict:
    """One process: logits, mean CE over the shifted targets, every gradient. Packed
    (``cu``): each document run alone (what packing must equal), targets within documents."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    docs = [(0, ids.shape[1])] if cu is None else list(zip(cu[:-1], cu[1:]))
    logits, total, count = [], 0.0, 0
    for lo, hi in docs:
        out = model(ids[:, lo:hi]).logits.float()
        logits.append(out)
        total = total + F.cross_entropy(
            out[:, :-1].reshape(-1, VOCAB), ids[:, lo + 1 : hi].reshape(-1), reduction="sum"
        )
        count += (hi - lo - 1) * ids.shape[0]
    loss = total / count
    loss.backward()
    return {"logits": torch.cat(logits, 1).detach(), "loss": loss.detach(), "grads": _grads(model)}


def cp_run(
    model: torch.nn.Module,
    ids: torch.Tensor,
    group: Any,
    layout: str,
    cu: list[int] | None = None,
    packed_as: str = "seq_lens",
) -> dict:
    """The same step under hp_cp: logits (unsharded), loss (summed), gradients (summed)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    handle = enable_cp(model, group, DeepSeekV4CPConfig(layout=layout))
    packing: dict[str, Any] = {}
    if cu is not None and packed_as == "seq_lens":
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        packing["seq_lens"] = torch.tensor([lens + [-1000, -1000]])  # NeMo pads with -1000
    elif cu is not None:
        packing["packed_seq_ids"] = torch.cat(
            [torch.full((b - a,), k + 1) for k, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
        )[None]
    batch = nemo_cp_batch(handle, ids, **packing)
    labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
    out = model(**batch).logits
    loss = cp_causal_lm_loss(out, labels, n_tokens)
    loss.backward()
    cp_sum_gradients(model.parameters(), group)
    logits = handle.unshard(out.detach().float(), 1, rows=ids.shape[1])
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    stats = handle.stats()
    disable_cp(handle)
    return {"logits": logits, "loss": total, "grads": _grads(model), "bytes_recv": stats["bytes_recv"]}


def compare(ref: dict, got: dict) -> dict[str, float]:
    """Worst relative errors (fp32) of logits, loss and every gradient; gradient None-ness."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    grad_err, missing = 0.0, []
    for name, g in ref["grads"].items():
        h = got["grads"][name]
        if (g is None) != (h is None):
            if g is not None and float(g.abs().max()) == 0.0:
                continue  # zero on one process, no token on any rank: equal
            missing.append(name)
            continue
        if g is not None and float(g.abs().max()) > 0:
            grad_err = max(grad_err, rel(h, g))
    return {
        "logits": rel(got["logits"], ref["logits"]),
        "loss": rel(got["loss"], ref["loss"]),
        "grads": grad_err,
        "n_grads": sum(g is not None for g in ref["grads"].values()),
        "missing": missing,
    }
