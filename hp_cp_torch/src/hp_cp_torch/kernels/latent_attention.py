"""Sparse MLA attention on the latents, for layers whose indexer picks the tokens each query
reads (DSA: DeepSeek V3.2, GLM-5): ``kv_b_proj`` folded into the queries and the output, each
query block reading its picks (as a dense masked band or gathered: the picked kernel,
:mod:`hp_cp_torch.kernels.picked`), recomputed in backward.

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

One autograd node for the layer's attention saves only its inputs (the queries, the picks,
``kv_b_proj``'s weight and the gathered latents) and each row's log-sum-exp, and recomputes
block by block in backward (Note [Picked attention: dense band or gather, per block] in
:mod:`hp_cp_torch.kernels.picked`). So a rank keeps its own rows' queries, as
transformers does, plus the gathered latents, and those are saved through autograd's saved
tensors, where ``CPConfig(regather_compressed_kv=True)`` can drop them after the
forward and receive them again in backward (Note [Re-gathered slots] in
:mod:`hp_cp_core.compression`). Nothing grows as ``S * S / cp`` and nothing is expanded per
global token. The sums differ from transformers' only in rounding order (fp32: about 1e-6).
An unselected pick (``-1``) gets weight exactly 0, as transformers' dense mask gives it; a row
with no pick at all (hp_cp's padding rows) gives 0.

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

import numpy as np
import torch

from hp_cp_core.columns import DenseBlock
from hp_cp_torch.kernels.picked import HeadLayout, attend_blocks

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
    blocks = [DenseBlock(lo, hi, 0, 0, _NONE, _NONE) for lo, hi in chunks]
    q = torch.cat([q_pass, q_rot], dim=-1).transpose(1, 2)  # [B, L, H, nope + rope]
    layout = HeadLayout.mla(dims.nope, dims.rope, dims.value, dims.rank)
    out = attend_blocks(q, latent, selected, blocks, layout, dims.scaling, None, kv_b_weight)
    return out.transpose(1, 2)


_NONE = np.zeros(0, dtype=np.int64)
