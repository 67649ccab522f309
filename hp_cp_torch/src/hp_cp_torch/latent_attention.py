"""Sparse MLA attention on the latents, for layers whose indexer picks the tokens each query
reads (DSA: DeepSeek V3.2, GLM-5): ``kv_b_proj`` folded into the queries and the output, each
query chunk reading only its picks, recomputed in backward.

Note [DSA attention on the latents]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers expands every token's latent ``c_j`` through ``kv_b_proj`` (``k_j = W_k c_j``,
``v_j = W_v c_j`` per head) and scores each query against all of them under a dense mask.
Under CP the latents a rank reads are the whole causal prefix, so expanding them costs
``H * (d_k + d_v)`` per token of the *global* sequence, and the dense ``[H, L, S]`` weights
kept for backward grow as ``S * S / cp``. The same numbers come from the latents::

    q . k_j = (W_k^T q_pass) . c_j + q_rot . k_rot_j      (q_latent . [c_j ; k_rot_j])
    sum_j p_j v_j = W_v (sum_j p_j c_j)

    latents [N, rank + rope]  --gather the picks-->  [l, k, rank + rope]   (one query chunk)
    q_latent [H, l, rank + rope] . picked  ->  p [H, l, k]  ->  p . picked[:rank]  ->  W_v

One autograd node per query chunk saves only its inputs (the chunk's ``q_pass`` / ``q_rot``,
its picks, ``kv_b_proj``'s weight and the gathered latents, which it shares with every other
chunk) and recomputes the chunk in backward. So a rank keeps its own rows' queries, as
transformers does, plus the gathered latents, and those are saved through autograd's saved
tensors, where ``DeepSeekV4CPConfig(regather_compressed_kv=True)`` can drop them after the
forward and receive them again in backward (Note [Re-gathered slots] in
:mod:`hp_cp_core.compression`). Nothing grows as ``S * S / cp`` and nothing is expanded per
global token. The sums differ from transformers' only in rounding order (fp32: about 1e-6).
An unselected pick (``-1``) gets ``finfo.min``, as transformers' dense mask gives it, so its
weight is exactly 0.

Rounding and the next layer's top-k: the indexer of the next layer picks its top-k from
scores of this layer's output, a discontinuous choice. Where two of its scores lie within
that rounding of each other at the k-th place, the pick can differ from the one process, and
the outputs then differ by far more than rounding. Measured on tiny V3.2 / GLM-5 models,
packed, S = 1000 ... 3000 (one process through the CP path against transformers): 1 of 10
configurations flipped a pick (logits 1.9e-2 off), the other 9 matched to 1e-6. DeepSeek's
and NeMo's sparse kernels compute this same absorbed form. ``attention_kernel="model_ops"``
runs transformers' own op order instead (0 of the 10 flipped; logits 7e-7 or closer), at the
memory of transformers' eager path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_ELEMENTS", "MLADims", "chunk_rows", "latent_attention"]

CHUNK_ELEMENTS = 1 << 24
"""Most elements a query chunk's picked latents and weights hold (``rows * k * (width +
heads)``): ~64 MiB in fp32 at any top-k, latent width and head count."""


def chunk_rows(query_chunk: int, picks: int, width: int, heads: int) -> int:
    """Query rows per chunk: at most ``query_chunk``, few enough that the chunk's picked
    latents ``[rows, picks, width]`` and weights ``[heads, rows, picks]`` stay under
    :data:`CHUNK_ELEMENTS` (at least one row)."""
    per_row = max(int(picks) * (int(width) + int(heads)), 1)
    return max(1, min(int(query_chunk), CHUNK_ELEMENTS // per_row))


@dataclass(frozen=True)
class MLADims:
    """The MLA head dims: ``nope`` (``qk_nope_head_dim``), ``rope`` (``qk_rope_head_dim``),
    ``value`` (``v_head_dim``), ``rank`` (``kv_lora_rank``), and the logits' ``scaling``."""

    nope: int
    rope: int
    value: int
    rank: int
    scaling: float


def latent_attention(
    q_pass: torch.Tensor,
    q_rot: torch.Tensor,
    latent: torch.Tensor,
    selected: torch.Tensor,
    kv_b_weight: torch.Tensor,
    dims: MLADims,
    chunks: Iterable[tuple[int, int]],
) -> torch.Tensor:
    """Each query's attention over the tokens it selected (Note [DSA attention on the latents]).

    Args:
        q_pass: ``[B, H, L, nope]``, the queries' unroped part.
        q_rot: ``[B, H, L, rope]``, roped.
        latent: ``[B, N, rank + rope]``, token ``j``'s ``[c_j ; k_rot_j]`` at row ``j``.
        selected: ``[B, L, k]`` token ids (rows of ``latent``), ``-1`` for none.
        kv_b_weight: ``kv_b_proj.weight``, ``[H * (nope + value), rank]``.
        dims: the head dims and scaling.
        chunks: ``(lo, hi)`` query ranges covering ``0 .. L`` in order (from the plan).

    Returns:
        ``[B, H, L, value]``, the heads' outputs before ``o_proj``.
    """
    outs = [
        _ChunkAttention.apply(
            q_pass[:, :, lo:hi], q_rot[:, :, lo:hi], latent, selected[:, lo:hi], kv_b_weight, dims
        )
        for lo, hi in chunks
    ]
    return torch.cat(outs, dim=2) if outs else q_pass.new_zeros((*q_pass.shape[:3], dims.value))


def _chunk_attention(
    q_pass: torch.Tensor,
    q_rot: torch.Tensor,
    latent: torch.Tensor,
    selected: torch.Tensor,
    kv_b_weight: torch.Tensor,
    dims: MLADims,
) -> torch.Tensor:
    w_kv = kv_b_weight.view(q_pass.shape[1], dims.nope + dims.value, dims.rank)
    w_k, w_v = torch.split(w_kv, [dims.nope, dims.value], dim=1)
    q_latent = torch.cat([torch.einsum("bhld,hdr->bhlr", q_pass, w_k), q_rot], dim=-1)
    batch, rows, picks = selected.shape
    ids = selected.clamp(min=0).reshape(batch, rows * picks, 1)
    picked = torch.gather(latent, 1, ids.expand(-1, -1, latent.shape[-1]))
    picked = picked.view(batch, rows, picks, -1)  # [B, l, k, rank + rope]
    neg = torch.finfo(q_latent.dtype).min
    bias = torch.zeros(selected.shape, dtype=q_latent.dtype, device=q_latent.device)
    bias = bias.masked_fill(selected < 0, neg).unsqueeze(1)  # [B, 1, l, k]
    w = torch.einsum("bhlc,blkc->bhlk", q_latent, picked) * dims.scaling + bias
    softmax_dtype = torch.promote_types(w.dtype, torch.float32)  # fp32 as transformers'
    w = F.softmax(w, dim=-1, dtype=softmax_dtype).to(q_latent.dtype)
    out_latent = torch.einsum("bhlk,blkr->bhlr", w, picked[..., : dims.rank])
    return torch.einsum("bhlr,hvr->bhlv", out_latent, w_v)


class _ChunkAttention(torch.autograd.Function):
    """One query chunk: forward without a graph, backward recomputes it from the saved inputs."""

    @staticmethod
    def forward(ctx: Any, q_pass, q_rot, latent, selected, kv_b_weight, dims):  # noqa: ANN001
        ctx.save_for_backward(q_pass, q_rot, latent, selected, kv_b_weight)
        ctx.dims = dims
        with torch.no_grad():
            return _chunk_attention(q_pass, q_rot, latent, selected, kv_b_weight, dims)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        q_pass, q_rot, latent, selected, kv_b_weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        inputs = [
            t.detach().requires_grad_(bool(n))
            for t, n in zip((q_pass, q_rot, latent), needs[:3], strict=True)
        ]
        weight = kv_b_weight.detach().requires_grad_(bool(needs[4]))
        with torch.enable_grad():
            out = _chunk_attention(*inputs, selected, weight, ctx.dims)
        wanted = [t for t in (*inputs, weight) if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        grads = [next(got) if t.requires_grad else None for t in (*inputs, weight)]
        return grads[0], grads[1], grads[2], None, grads[3], None
