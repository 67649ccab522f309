"""Parity of a tiny random transformers ``DeepseekV4ForCausalLM`` under CP vs one device.

``run_parity(rank, world)`` is what ``hp-cp demo --model transformers`` runs on each rank
(inside an initialised ``torch.distributed`` group, e.g. via
:func:`hp_cp_torch.cli.launch.run_ranks`): every rank builds the same tiny model (same seed; the
attention parameters, ``sinks`` and ``position_bias`` re-randomised so nothing is
degenerate), runs it on the full sequence as the single-device reference, then under CP on
its shard, forward and backward of the causal-LM loss, and reports the largest relative
errors (logits, loss, per-layer attention outputs, per-parameter gradients summed over the
ranks), the bytes CP moved and the times.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hp_cp_core import CPConfig, disable_cp, enable_cp
from hp_cp_torch.integrations.transformers import (
    cp_causal_lm_loss,
    cp_shift_labels,
    cp_sum_gradients,
)

__all__ = [
    "TINY_CONFIG",
    "Reference",
    "build_tiny_model",
    "cp_parity",
    "make_inputs",
    "reference_run",
    "run_parity",
]

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)

# All three layer types; S = 264 gives 66 CSA slots (top-k 4 << visible) and 2 HCA slots.
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    partial_rotary_factor=0.25,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    layer_types=[SLIDING, CSA, HCA],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 128},
    sliding_window=16,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=4,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    max_position_embeddings=1048576,
    attention_dropout=0.0,
    use_cache=False,
)


def build_tiny_model(seed: int = 0, **overrides: Any) -> Any:
    """The tiny fp32 eager ``DeepseekV4ForCausalLM`` (identical on every rank for one seed).

    HF initialises ``sinks`` / ``position_bias`` to 0 and everything with std 0.02; the
    attention parameters are re-drawn (std 1/sqrt(fan_in), norms ~1, sinks and position
    biases ~N(0, 0.5^2)) and the hash router's ``tid2eid`` randomised, so the checks see
    O(1) attention activations.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**TINY_CONFIG, **overrides})
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float()
    return randomise_attention_weights(model, cfg.n_routed_experts, seed)


def randomise_attention_weights(model: Any, n_routed_experts: int, seed: int = 0) -> Any:
    """Re-draw a tiny DeepSeek V4 model's attention parameters (std 1/sqrt(fan_in), norms ~1,
    sinks and position biases ~N(0, 0.5^2)) and randomise the hash router's ``tid2eid``, in
    place, the same for one seed on every rank; returns ``model``. Works on any model whose
    parameter names and layers follow HF's (VeOmni's generated copy too).
    """
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." not in name:
                continue
            if name.endswith("sinks") or name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for layer in model.model.layers:
            if getattr(layer.mlp, "is_hash", False):
                tid = layer.mlp.gate.tid2eid
                tid.copy_(torch.randint(0, n_routed_experts, tid.shape, generator=g))
    return model


def make_inputs(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Random token ids ``[batch, seq_len]`` (the same on every rank for one seed)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


@dataclass
class Reference:
    """The single-device run: what CP is compared with."""

    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    attn_out: list[torch.Tensor]
    seconds: float
    topk_rows_selecting: int = 0
    topk_boundary_ties: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _attn_modules(model: Any) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


def _capture_attn(model: Any, store: list[Any]) -> list[Any]:
    hooks = []
    for i, attn in enumerate(_attn_modules(model)):
        store.append(None)

        def hook(_mod, _args, out, i=i):
            store[i] = out[0].detach()

        hooks.append(attn.register_forward_hook(hook))
    return hooks


def _capture_scores(model: Any, store: list[Any]) -> list[Any]:
    hooks = []
    for attn in _attn_modules(model):
        indexer = getattr(attn.compressor, "indexer", None)
        if indexer is not None:
            hooks.append(
                indexer.scorer.register_forward_hook(
                    lambda _m, _a, out: store.append((out.detach(), _m))
                )
            )
    return hooks


def _tie_stats(model: Any, scores: list[Any], seq_len: int) -> tuple[int, int]:
    """Rows whose indexer really selects (visible > k), and ties at the k-th place among them."""
    rows = ties = 0
    for sc, _ in scores:
        k = int(model.config.index_topk)
        r = int(model.config.compress_rates[CSA])
        visible = (torch.arange(seq_len) + 1) // r  # [S]
        cols = torch.arange(sc.shape[-1])
        sc = sc.masked_fill(cols[None, None, :] >= visible[None, :, None], float("-inf"))
        if sc.shape[-1] <= k:
            continue
        srt = sc.sort(dim=-1, descending=True).values
        selecting = (visible > k)[None, :].expand(sc.shape[0], -1)
        rows += int(selecting.sum())
        ties += int(((srt[..., k - 1] == srt[..., k]) & selecting).sum())
    return rows, ties


def _zero_grads(model: Any) -> None:
    for p in model.parameters():
        p.grad = None


def reference_run(model: Any, ids: torch.Tensor) -> Reference:
    """Forward and backward of HF's causal-LM loss on the full sequence (no CP)."""
    model.train()
    _zero_grads(model)
    seq_len = ids.shape[1]
    attn_out: list[Any] = []
    scores: list[Any] = []
    hooks = _capture_attn(model, attn_out) + _capture_scores(model, scores)
    try:
        t0 = time.perf_counter()
        out = model(
            input_ids=ids, position_ids=torch.arange(seq_len)[None], labels=ids, use_cache=False
        )
        out.loss.backward()
        seconds = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    rows, ties = _tie_stats(model, scores, seq_len)
    grads = {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }
    _zero_grads(model)
    return Reference(out.logits.detach(), out.loss.detach(), grads, attn_out, seconds, rows, ties)


def _rel(a: torch.Tensor | None, b: torch.Tensor | None, like: torch.Tensor) -> float:
    a = torch.zeros_like(like) if a is None else a
    b = torch.zeros_like(like) if b is None else b
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _layer_of(name: str) -> str:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return f"layer{m.group(1)}" if m else "other"


def cp_parity(
    model: Any,
    ids: torch.Tensor,
    ref: Reference,
    group: Any,
    layout: str = "contiguous",
    *,
    hf_loss: bool = False,
    config: CPConfig | None = None,
) -> dict[str, Any]:
    """Run ``model`` under CP on ``group`` and compare with ``ref`` (every rank of the group).

    The loss follows the documented recipe: labels shifted on the full sequence, sharded,
    ``cp_causal_lm_loss`` per rank (``hf_loss=True``: HF's own loss through
    ``shift_labels=`` and ``num_items_in_batch=``), backward, gradients summed over the group.
    """
    config = config or CPConfig(layout=layout)
    batch, seq_len = ids.shape
    model.train()
    _zero_grads(model)
    handle = enable_cp(model, group, config)
    attn_out: list[Any] = []
    hooks = _capture_attn(model, attn_out)
    try:
        pos = torch.arange(seq_len)[None]
        shifted = cp_shift_labels(ids)
        n_tok = (shifted != -100).sum()
        local_ids, local_pos = handle.shard(ids, 1), handle.shard(pos, 1)
        local_labels = handle.shard(shifted, 1)
        t0 = time.perf_counter()
        if hf_loss:
            out = model(
                input_ids=local_ids,
                position_ids=local_pos,
                labels=local_labels,
                shift_labels=local_labels,
                num_items_in_batch=n_tok,
                use_cache=False,
            )
            loss = out.loss
        else:
            out = model(input_ids=local_ids, position_ids=local_pos, use_cache=False)
            loss = cp_causal_lm_loss(out.logits, local_labels, n_tok)
        t_fwd = time.perf_counter() - t0
        loss.backward()
        seconds = time.perf_counter() - t0
        stats = handle.stats()
        cp_sum_gradients(model.parameters(), group)
        with torch.no_grad():
            logits = handle.unshard(out.logits.detach(), 1)
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            attn_full = [handle.unshard(o, 1) for o in attn_out]
    finally:
        for h in hooks:
            h.remove()
        disable_cp(handle)
    names = dict(model.named_parameters())
    grad_err: dict[str, float] = {}
    presence = []
    for n, p in names.items():
        got, want = p.grad, ref.grads[n]
        grad_err[n] = _rel(got, want, p)
        if (got is None) != (want is None):
            presence.append(n)
    per_layer: dict[str, float] = {}
    for n, e in grad_err.items():
        key = _layer_of(n)
        per_layer[key] = max(per_layer.get(key, 0.0), e)
    worst = max(grad_err, key=grad_err.get)
    _zero_grads(model)
    types = [a.layer_type for a in _attn_modules(model)]
    return {
        "cp": handle.cp_size,
        "rank": handle.cp_rank,
        "layout": layout,
        "seq_len": seq_len,
        "batch": batch,
        "layer_types": types,
        "loss_via": "hf(shift_labels, num_items_in_batch)" if hf_loss else "cp_causal_lm_loss",
        "logits_rel_err": _rel(logits, ref.logits, ref.logits),
        "loss": float(total),
        "loss_ref": float(ref.loss),
        "loss_rel_err": abs(float(total) - float(ref.loss)) / abs(float(ref.loss)),
        "attn_out_rel_err": {
            f"layer{i}:{t}": _rel(a, b, b)
            for i, (t, a, b) in enumerate(zip(types, attn_full, ref.attn_out))
        },
        "grad_rel_err_max": grad_err[worst],
        "grad_rel_err_worst_param": worst,
        "grad_rel_err_per_layer": per_layer,
        "grad_presence_mismatch": presence,
        "params_without_grad_ref": sum(g is None for g in ref.grads.values()),
        "topk_rows_selecting": ref.topk_rows_selecting,
        "topk_boundary_ties": ref.topk_boundary_ties,
        "bytes_sent": stats["bytes_sent"],
        "bytes_recv": stats["bytes_recv"],
        "collectives": stats["collectives"],
        "plan_cache": stats["plan_cache"],
        "time_single_s": ref.seconds,
        "time_cp_fwd_s": t_fwd,
        "time_cp_fwd_bwd_s": seconds,
    }


def run_parity(
    rank: int,
    world: int,
    layout: str = "contiguous",
    seq_len: int = 264,
    *,
    batch: int = 2,
    seed: int = 0,
    dtype: str = "float32",
    **config_overrides: Any,
) -> dict[str, Any]:
    """One rank of the transformers demo: tiny model, single-device vs CP on ``world`` ranks.

    ``seq_len`` must be a multiple of ``world`` (``2 * world`` for ``"load_balanced"``);
    ``dtype`` is ``"float32"`` or ``"bfloat16"`` (bf16: expect ~1e-2 errors, and indexer picks
    that may differ where bf16 rounding reorders close scores). Returns this rank's report
    (see :func:`cp_parity`); every rank reports the same errors.
    """
    if not dist.is_initialized() or dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError(
            f"run_parity(rank={rank}, world={world}) needs an initialised torch.distributed "
            "group of that size (hp_cp_torch.cli.launch.run_ranks sets one up)."
        )
    model = build_tiny_model(seed, **config_overrides).to(getattr(torch, dtype))
    ids = make_inputs(model.config.vocab_size, batch, seq_len, seed)
    report = cp_parity(model, ids, reference_run(model, ids), dist.group.WORLD, layout)
    report["dtype"] = dtype
    return report
