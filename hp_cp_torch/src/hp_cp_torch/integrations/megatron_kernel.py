"""Megatron's own sparse attention on hp_cp's exchange: ``attention_kernel="megatron"``.

Under CP hp_cp moves each rank the latents of the causal prefix its queries read and picks the
top-k as Megatron does on one process; what runs on them is, by default, hp_cp's latent kernel
(:mod:`hp_cp_torch.kernels.latent_attention`). This module runs megatron-core 0.19.2's own instead
(``attention_kernel="megatron"``, :data:`hp_cp_torch.kernels.megatron.MEGATRON`, which the
Megatron adapter's ``attention`` answers with :func:`megatron_sparse_attention`):
``dsa._run_sparse_attention`` with ``absorbed_mla=True``, the function ``DSAttention.forward``
calls, so whatever ``dsa_kernel_backend`` selects runs (its fused ``tilelang`` / ``cudnn``
absorbed sparse attention where the config names one and the attention backend is not
``unfused``; its unfused PyTorch path otherwise, or where a fused backend declines the shape).

Note [Megatron's kernel on hp_cp's prefix]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron's ``AbsorbedMLASelfAttention`` hands its core attention the absorbed queries
(``q_no_pe`` times the K up weight, then the roped ``q_pe``) ``[sq, b, heads, c + r]``, the
latent keys ``[skv, b, 1, c + r]`` of the whole sequence and the top-k as rows of those keys;
its unfused path scores every key (``[b, heads, sq, skv]``) and masks all but the picks. Here
each query chunk of a rank (never straddling the two runs of a load-balanced rank) gets:

* its absorbed queries, from hp_cp's queries (already roped at global positions) by
  Megatron's own einsum with the K half of ``linear_kv_up_proj.weight``, split per head as
  ``_get_kv_up_weights()`` splits it (the V half is Megatron's ``up_v_weight``);
* as keys, the gathered latents of the slots its queries can see, ``first .. stop`` (the union
  of their visible ranges: the causal prefix, from the first query's document start when
  packed), with their global positions (``key_positions``; ``None``, Megatron's identity, when
  the range starts at slot 0);
* the picks as rows of those keys (global slot minus ``first``, ``-1`` kept), and each query's
  visible range as Megatron's varlen bounds, so the unfused path masks exactly the keys
  Megatron's own masks leave (the picks are visible by construction: the fused paths, which
  take no mask, read the same columns).

Megatron returns ``[rows, b, heads * v]`` after its own V up projection. The rows per chunk
are bounded so that ``b x (heads + 1) x rows x keys`` stays under :data:`CHUNK_ELEMENTS` (the
unfused path's scores and index mask), and each chunk is one autograd node that keeps only its
inputs and recomputes Megatron's call in backward: the memory of a step grows with the rank's
rows and the gathered prefix, never with ``heads x (S / cp) x S``. Rounding: the unfused path
computes the scores and the softmax in fp32 and the weighted sum in the latents' dtype, as on
one process; the sums of a chunk are the same sums, so fp32 matches one process to about 1e-7.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from hp_cp_core import HpCpError
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.model.spec import PlanView

__all__ = ["CHUNK_ELEMENTS", "megatron_sparse_attention"]

DSA = "megatron.core.transformer.experimental_attention_variant.dsa"

CHUNK_ELEMENTS = 1 << 24
"""Most ``(batch x (heads + 1) x rows x keys)`` elements one query chunk's call may score (the
unfused path's fp32 scores and index mask: about 64 MiB each)."""


def megatron_sparse_attention(
    module: nn.Module, request: AttentionRequest, view: PlanView
) -> torch.Tensor:
    """Megatron's ``_run_sparse_attention`` (absorbed MLA) of ``module``
    (``AbsorbedMLASelfAttention``) on the request's queries ``[B, L, H, qk_head_dim + rope]``,
    gathered latents ``[B, N, kv_lora_rank + rope]`` and picks ``[B, L, k]`` (global slot
    ids, ``-1`` none), in query chunks of the plan's runs and visible slots (``view``, the
    layer's ``state.view``; Note [Megatron's kernel on hp_cp's prefix]).

    Returns:
        ``[B, L, H, v_head_dim]``, the heads' values before ``linear_proj``.

    Raises:
        HpCpError: the request has no gathered latents or no picks (a layer without
            Megatron's indexer or a shared selection).
    """
    if request.cmp_kv is None or request.selected is None:
        raise HpCpError(
            "attention_kernel='megatron': the layer has no gathered latents or no top-k "
            "picks; Megatron's sparse attention runs on DSA layers (an indexer, or "
            "IndexShare's shared picks)."
        )
    config = module.config
    batch, _length, heads = request.q.shape[:3]
    q_no_pe, q_pe = torch.split(
        request.q, [int(config.qk_head_dim), int(config.qk_pos_emb_head_dim)], dim=-1
    )
    device = request.q.device
    first = torch.as_tensor(view.slot_start, device=device).long()
    stop = first + torch.as_tensor(view.slot_count, device=device).long()
    first_host, stop_host = view.slot_start, view.slot_start + view.slot_count
    outs = []
    for a, b, _ in view.runs:
        longest = int(stop_host[a:b].max() - first_host[a:b].min()) if b > a else 1
        per_row = batch * (heads + 1) * max(longest, 1)
        step = max(1, min(int(request.query_chunk), CHUNK_ELEMENTS // per_row))
        for lo in range(a, b, step):
            hi = min(lo + step, b)
            lo_key, hi_key = int(first_host[lo:hi].min()), int(stop_host[lo:hi].max())
            picks = request.selected[:, lo:hi].to(device).long()
            picks = torch.where(picks >= 0, picks - lo_key, -1)
            bounds = (first[lo:hi], stop[lo:hi], lo_key, hi_key)
            outs.append(
                _MegatronChunk.apply(
                    q_no_pe[:, lo:hi],
                    q_pe[:, lo:hi],
                    request.cmp_kv,
                    module.linear_kv_up_proj.weight,
                    picks,
                    bounds,
                    module,
                    request.scale,
                )
            )
    if not outs:
        return request.q.new_zeros((*request.q.shape[:3], int(config.v_head_dim)))
    return torch.cat(outs, dim=1)


def _chunk(
    q_no_pe: torch.Tensor,
    q_pe: torch.Tensor,
    latents: torch.Tensor,
    kv_up: torch.Tensor,
    picks: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor, int, int],
    module: nn.Module,
    scale: float,
) -> torch.Tensor:
    """One query chunk through Megatron's ``_run_sparse_attention``: ``[B, l, H, v]``."""
    config = module.config
    dsa = importlib.import_module(DSA)  # looked up per call (a test may replace it)
    heads, rank = q_no_pe.shape[2], int(config.kv_lora_rank)
    kv_up = kv_up.view(heads, int(config.qk_head_dim) + int(config.v_head_dim), rank)
    k_up, v_up = torch.split(kv_up, [int(config.qk_head_dim), int(config.v_head_dim)], dim=1)
    query = torch.einsum("...nd,ndk->...nk", q_no_pe.transpose(0, 1), k_up)
    query = torch.cat([query, q_pe.transpose(0, 1)], dim=-1).contiguous()  # [l, B, H, c + r]
    starts, stops, lo_key, hi_key = bounds
    key = latents[:, lo_key:hi_key].transpose(0, 1).unsqueeze(2).contiguous()  # [n, B, 1, c+r]
    positions = None
    if lo_key:
        positions = torch.arange(lo_key, hi_key, device=key.device)
    out = dsa._run_sparse_attention(
        absorbed_mla=True,
        query=query,
        key=key,
        value=None,
        up_v_weight=v_up.to(dtype=query.dtype).contiguous(),
        topk_indices=picks,
        softmax_scale=scale,
        config=config,
        mask=None,
        varlen_starts=starts,
        varlen_ends=stops,
        key_positions=positions,
    )  # [l, B, H * v]
    return out.view(out.shape[0], out.shape[1], heads, -1).transpose(0, 1)


class _MegatronChunk(torch.autograd.Function):
    """One query chunk: forward without a graph, backward re-runs Megatron's call."""

    @staticmethod
    def forward(ctx: Any, q_no_pe, q_pe, latents, kv_up, picks, bounds, module, scale):  # noqa: ANN001
        ctx.save_for_backward(q_no_pe, q_pe, latents, kv_up, picks, bounds[0], bounds[1])
        ctx.keys, ctx.module, ctx.scale = bounds[2:], module, scale
        with torch.no_grad():
            return _chunk(q_no_pe, q_pe, latents, kv_up, picks, bounds, module, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        q_no_pe, q_pe, latents, kv_up, picks, starts, stops = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        inputs = [
            t.detach().requires_grad_(bool(n))
            for t, n in zip((q_no_pe, q_pe, latents, kv_up), needs, strict=True)
        ]
        bounds = (starts, stops, *ctx.keys)
        with torch.enable_grad():
            out = _chunk(*inputs, picks, bounds, ctx.module, ctx.scale)
        wanted = [t for t in inputs if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        grads = [next(got) if t.requires_grad else None for t in inputs]
        return (*grads, None, None, None, None)
