"""Single-device reference of the DeepSeek V4 attention layer (SWA, CSA and HCA).

This follows DeepSeek's released inference code (docs/semantics.md)
for prefill / training, without the fp8/fp4 quantisation simulation and without the
indexer's Hadamard rotation (an orthogonal map applied to both the indexer queries and keys,
so it leaves every score unchanged up to rounding). Packed sequences follow Megatron's
per-document grid (section 6 of that file).

The stages are exposed as methods so a context-parallel path can run them on its local rows:
``project`` (token-local projections), ``compressor`` / ``indexer`` (the only cross-token
parts besides attention), ``select_slots`` (indexer top-k), ``attend`` (sparse attention with
the sink ``attn_sink``; a model without one sets it to ``None``) and ``output`` (inverse
RoPE and grouped output projection).

Conventions (padded input ``x [B, S, hidden]``):

* ``position_ids`` only set the RoPE angle of q, kv, the indexer q and the inverse RoPE of the
  output. The sequence structure (window, compression grid, slot visibility) follows the row
  index ``t`` in ``0..S-1``, and compressed slot ``j`` is rotated at position ``j * r``.
* The KV pool of a sequence is ``[kv (S rows) ; compressed slots (S // r rows)]``: slot ``j``
  is pool row ``S + j``.
* Index list of query ``t``, in this column order: ``W`` window columns
  ``max(0, t-W+1) .. t`` ascending, ``-1`` padded at the end; then for r = 128 every slot
  ``S + j`` ascending (``-1`` unless ``(j+1)*r <= t+1``), for r = 4 the indexer's
  ``min(index_topk, S // 4)`` picks in descending-score order (lower slot first on ties;
  ``-1`` for picks of invisible slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn

from hp_cp_torch.attention import deterministic_topk
from hp_cp_torch.kernels.smallop import sparse_attention_smallop
from hp_cp_torch.model.indexer_loss import attach_indexer_loss, indexer_kl_rows, indexer_scores_at

__all__ = [
    "Compressor",
    "DeepSeekV4Attention",
    "DeepSeekV4AttentionConfig",
    "Indexer",
    "RMSNorm",
    "RotaryEmbedding",
    "hca_slot_indices",
    "rope_frequencies",
    "window_indices",
]


@dataclass(frozen=True)
class DeepSeekV4AttentionConfig:
    """Sizes and options of one DeepSeek V4 attention layer.

    The defaults build a tiny layer for tests; the released models use hidden 4096/7168,
    64/128 heads of 512 (rope 64), q_lora 1024/1536, 8/16 output groups of rank 1024,
    window 128, 64 indexer heads of 128 and top-k 512/1024 (the released configs).

    Attributes:
        hidden_size: Model width (``dim`` in [DS]).
        n_heads: Query heads; there is one shared KV head.
        head_dim: Width of q, k and v (K == V).
        rope_head_dim: The last ``rope_head_dim`` channels of every head get RoPE.
        q_lora_rank: Width of the low-rank query (``qr``, also the indexer's query input).
        o_groups: Groups of the grouped output projection.
        o_lora_rank: Per-group rank of the output projection.
        window_size: Sliding window ``W``, including the query itself; 0 (no window, as
            :class:`hp_cp_core.LayerSpec` allows) for a layer with compressed slots, whose
            first ``r - 1`` rows of a sequence then see nothing (output 0 without a sink).
        compress_ratio: 0 (sliding window only), 4 (CSA, overlapping compressor plus
            indexer) or 128 (HCA).
        index_n_heads: Indexer heads (r = 4 only).
        index_head_dim: Indexer head width (r = 4 only).
        index_topk: Compressed slots picked per query by the indexer (r = 4 only).
        rope_theta: RoPE base of r = 0 layers (never YaRN).
        compress_rope_theta: RoPE base of r > 0 layers (with YaRN when enabled).
        norm_eps: RMSNorm epsilon.
        rope_factor: YaRN factor.
        original_seq_len: YaRN original context; 0 turns YaRN off.
        beta_fast: YaRN high-frequency cutoff.
        beta_slow: YaRN low-frequency cutoff.
        indexer_loss_coeff: Weight of the indexer KL loss in training (r = 4 only); 0 still
            runs the loss's backward (zero gradients), so every parameter gets a gradient.
    """

    hidden_size: int = 64
    n_heads: int = 4
    head_dim: int = 32
    rope_head_dim: int = 8
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    window_size: int = 128
    compress_ratio: int = 4
    index_n_heads: int = 2
    index_head_dim: int = 16
    index_topk: int = 4
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    norm_eps: float = 1e-6
    rope_factor: float = 1.0
    original_seq_len: int = 0
    beta_fast: int = 32
    beta_slow: int = 1
    indexer_loss_coeff: float = 0.01

    def __post_init__(self) -> None:
        if self.compress_ratio not in (0, 4, 128):
            raise ValueError(f"compress_ratio must be 0, 4 or 128, got {self.compress_ratio}")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= self.head_dim:
            raise ValueError(
                f"rope_head_dim must be even and in (0, head_dim={self.head_dim}], "
                f"got {self.rope_head_dim}"
            )
        if self.compress_ratio == 4 and not self.rope_head_dim <= self.index_head_dim:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be >= rope_head_dim "
                f"({self.rope_head_dim}) for compress_ratio 4"
            )
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"n_heads * head_dim ({self.n_heads * self.head_dim}) must be divisible by "
                f"o_groups ({self.o_groups})"
            )
        if self.window_size < 0 or (self.compress_ratio == 0 and self.window_size < 1):
            raise ValueError(
                f"window_size must be >= 1 (or 0 with compress_ratio 4 or 128), got "
                f"{self.window_size} with compress_ratio {self.compress_ratio}"
            )
        if not self.indexer_loss_coeff >= 0:
            raise ValueError(f"indexer_loss_coeff must be >= 0, got {self.indexer_loss_coeff}")


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """RMSNorm with a weight; computes in fp32 and returns the input dtype ([DS])."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * _rms_normalize(x.float(), self.eps)).to(x.dtype)


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def rope_frequencies(
    rope_dim: int,
    base: float,
    factor: float = 1.0,
    original_seq_len: int = 0,
    beta_fast: int = 32,
    beta_slow: int = 1,
) -> torch.Tensor:
    """Per-pair rotary frequencies ``[rope_dim // 2]`` (fp32), with YaRN when enabled.

    Mirrors [DS] ``precompute_freqs_cis``: ``f_i = base^(-2i/rd)``; with YaRN
    (``original_seq_len > 0``) ``f_i = f_i/factor*(1-smooth) + f_i*smooth``. No mscale.

    Args:
        rope_dim: Number of rotated channels (even).
        base: RoPE base (theta).
        factor: YaRN factor.
        original_seq_len: YaRN original context length; 0 disables YaRN.
        beta_fast: YaRN high-frequency cutoff (rotations).
        beta_slow: YaRN low-frequency cutoff (rotations).

    Returns:
        The frequencies, fp32, on the CPU.
    """
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:

        def correction_dim(rotations: float) -> float:
            return (
                rope_dim
                * math.log(original_seq_len / (rotations * 2 * math.pi))
                / (2 * math.log(base))
            )

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


class RotaryEmbedding:
    """Interleaved-pair RoPE on the last ``rope_dim`` channels.

    Channel pairs ``(2i, 2i+1)`` of the rotated part are rotated as complex numbers by angle
    ``position * f_i``. The math runs in fp32 and the result has the input dtype. This is a
    plain object (not a module), so ``module.to(dtype)`` never casts the frequency table.

    Args:
        rope_dim: Number of rotated channels (the last ones of each vector).
        freqs: Frequencies ``[rope_dim // 2]`` from :func:`rope_frequencies`.
    """

    def __init__(self, rope_dim: int, freqs: torch.Tensor) -> None:
        self.rope_dim = rope_dim
        self.freqs = freqs

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """Rotate ``x[..., -rope_dim:]``.

        Args:
            x: Tensor ``[..., d]``.
            positions: Integer positions broadcastable to ``x.shape[:-1]``.
            inverse: Rotate by the negative angle (the conjugate), undoing a forward rotation.

        Returns:
            A new tensor like ``x``.
        """
        rd = self.rope_dim
        angle = positions.to(torch.float32)[..., None] * self.freqs.to(x.device)
        cos, sin = angle.cos(), angle.sin()
        if inverse:
            sin = -sin
        pairs = x[..., -rd:].float().unflatten(-1, (rd // 2, 2))
        re, im = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


def window_indices(
    seq_len: int, window_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """Window columns of every query of one sequence: ``[seq_len, window_size]`` int64.

    Row ``t`` is ``max(0, t-W+1) .. t`` ascending, then ``-1`` padding at the end.
    """
    t = torch.arange(seq_len, device=device)[:, None]
    cols = (t - window_size + 1).clamp(min=0) + torch.arange(window_size, device=device)
    return torch.where(cols > t, -1, cols)


def hca_slot_indices(seq_len: int, ratio: int, device: torch.device | None = None) -> torch.Tensor:
    """Every compressed slot of one sequence, per query: ``[seq_len, seq_len // ratio]``.

    Entry ``(t, j)`` is the slot id ``j`` if the slot is visible to ``t``
    (``(j+1)*ratio <= t+1``), else ``-1``. Add the pool offset for KV-pool rows.
    """
    j = torch.arange(seq_len // ratio, device=device)
    visible = (torch.arange(seq_len, device=device)[:, None] + 1) // ratio
    return torch.where(j < visible, j, -1)


# --------------------------------------------------------------------------- compressor


class Compressor(nn.Module):
    """Gated pooling of each block of ``ratio`` rows into one compressed KV slot.

    For ratio 4 every slot also reads the previous block ("overlap"): the first ``d`` of the
    ``2d`` projected channels play the previous-block role, the last ``d`` the current-block
    role. The gate is a softmax over the rows of the (8- or 128-row) window, separately per
    channel. Pooling runs in fp32; the pooled vector is cast to the input dtype, RMS-normed
    and rotated at the position of its block's first row (docs/semantics.md section 3).

    Segment property: ``forward`` only needs a contiguous run of rows. Called on rows
    ``[a, b)`` (``a`` a multiple of ``ratio``) with ``rope_pos_offset=a``, its slots equal the
    full-sequence slots ``a/ratio ...``, except that for ratio 4 the first one lacks its
    predecessor block and must be dropped (or the call started one block earlier).

    Args:
        hidden_size: Input width.
        head_dim: Width ``d`` of a compressed slot.
        ratio: Block length (4 or 128).
        rope: The layer's rotary embedding.
        eps: RMSNorm epsilon.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, ratio: int, rope: RotaryEmbedding, eps: float
    ) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.rope = head_dim, ratio, rope
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.wkv = nn.Linear(hidden_size, coff * head_dim, bias=False)
        self.wgate = nn.Linear(hidden_size, coff * head_dim, bias=False)
        self.ape = nn.Parameter(0.1 * torch.randn(ratio, coff * head_dim))
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, rope_pos_offset: int = 0) -> torch.Tensor:
        """Compress the complete blocks of ``x``.

        Args:
            x: Rows ``[B, n, hidden]`` of one sequence (or document) segment; row 0 starts a
                block. Its first block has no predecessor (kv 0, score -inf).
            rope_pos_offset: Sequence position of row 0 (a multiple of ``ratio``); slot ``j``
                is rotated at ``rope_pos_offset + j * ratio``.

        Returns:
            Slots ``[B, n // ratio, head_dim]`` in ``x``'s dtype; the trailing ``n % ratio``
            rows are not compressed.
        """
        n, r = x.shape[1], self.ratio
        n_slots = n // r
        # No early return for n < r: the empty result stays connected to the weights, so a
        # CP rank that owns no slot still joins the gather's backward (symmetric collectives).
        xs = x[:, : n_slots * r].float()
        # [B, n_slots, r, coff*d]
        kv = nn.functional.linear(xs, self.wkv.weight.float()).unflatten(1, (n_slots, r))
        score = nn.functional.linear(xs, self.wgate.weight.float()).unflatten(1, (n_slots, r))
        score = score + self.ape.float()  # ape row = offset inside the block, before the shuffle
        if self.overlap:
            kv = self._overlap(kv, 0.0)  # [B, n_slots, 2r, d]
            score = self._overlap(score, float("-inf"))
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)  # [B, n_slots, d], fp32
        slots = self.norm(pooled.to(x.dtype))
        positions = rope_pos_offset + r * torch.arange(n_slots, device=x.device)
        return self.rope(slots, positions)

    def _overlap(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        """``[B, n, r, 2d] -> [B, n, 2r, d]``: previous block's first half, own second half."""
        d = self.head_dim
        first = torch.full_like(t[:, :1, :, :d], fill)  # predecessor of the first block
        prev = torch.cat((first, t[:, :-1, :, :d]), dim=1)
        return torch.cat((prev, t[..., d:]), dim=2)


# --------------------------------------------------------------------------- indexer


class Indexer(nn.Module):
    """Lightning indexer of CSA (ratio 4): scores compressed slots for each query.

    ``score[t, j] = sum_h w[t, h] * ReLU(qI[t, h] . KI[j])``, computed in fp32. [DS] applies a
    Hadamard rotation to both ``qI`` and ``KI``; it is orthogonal, so it leaves the dot
    products unchanged up to rounding, and is left out here.

    Args:
        config: The layer configuration.
        rope: The layer's rotary embedding (shared with the main branch).
    """

    def __init__(self, config: DeepSeekV4AttentionConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope = config.index_n_heads, config.index_head_dim, rope
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(config.hidden_size, self.head_dim, 4, rope, config.norm_eps)

    def queries(self, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Indexer queries ``qI [B, S, nh, Di]``.

        Args:
            qr: Low-rank queries ``[B, S, q_lora_rank]``.
            positions: RoPE positions ``[B, S]`` (or broadcastable to it).
        """
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        return self.rope(q, positions[..., None])

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head weights ``[B, S, nh]`` with ``Di**-0.5 * nh**-0.5`` folded in ([DS])."""
        return self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)

    def scores(self, q_idx: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores ``[B, S, n_slots]`` (fp32, no visibility mask).

        Args:
            q_idx: Indexer queries ``[B, S, nh, Di]``.
            w: Head weights ``[B, S, nh]``.
            keys: Indexer compressed keys ``[B, n_slots, Di]``.
        """
        logits = torch.einsum("bshd,bjd->bshj", q_idx.float(), keys.float()).relu()
        return torch.einsum("bshj,bsh->bsj", logits, w.float())


# --------------------------------------------------------------------------- the layer


class DeepSeekV4Attention(nn.Module):
    """DeepSeek V4 attention layer (sliding window, CSA or HCA by ``compress_ratio``).

    See the module docstring for the index conventions. Gradients: the indexer branch sees
    ``x.detach()`` and ``qr.detach()`` (Megatron training semantics) and its top-k is
    discrete, so the indexer parameters learn only from the indexer KL loss, which a CSA
    layer computes in training mode (``indexer_loss_coeff``; value in :attr:`indexer_loss`).

    Args:
        config: The layer configuration.
    """

    def __init__(self, config: DeepSeekV4AttentionConfig | None = None) -> None:
        super().__init__()
        config = config or DeepSeekV4AttentionConfig()
        self.config = config
        c = config
        self.n_heads, self.head_dim, self.window_size = c.n_heads, c.head_dim, c.window_size
        self.compress_ratio = c.compress_ratio
        self.softmax_scale = c.head_dim**-0.5
        if c.compress_ratio:
            freqs = rope_frequencies(
                c.rope_head_dim,
                c.compress_rope_theta,
                c.rope_factor,
                c.original_seq_len,
                c.beta_fast,
                c.beta_slow,
            )
        else:  # sliding-window layers never use YaRN
            freqs = rope_frequencies(c.rope_head_dim, c.rope_theta)
        self.rope = RotaryEmbedding(c.rope_head_dim, freqs)

        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.norm_eps)
        self.attn_sink = nn.Parameter(torch.randn(c.n_heads, dtype=torch.float32))
        # wo_a.weight [G*o_lora, H*D/G] is used viewed as [G, o_lora, H*D/G], as in [DS].
        self.wo_a = nn.Linear(
            c.n_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, bias=False
        )
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.indexer_loss: torch.Tensor | None = None  # the last training forward's KL mean
        self.compressor: Compressor | None = None
        if c.compress_ratio:
            args = (c.hidden_size, c.head_dim, c.compress_ratio, self.rope, c.norm_eps)
            self.compressor = Compressor(*args)
        self.indexer = Indexer(c, self.rope) if c.compress_ratio == 4 else None

    # ------------------------------------------------------------------ stages

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-local projections (docs/semantics.md section 1).

        Args:
            x: Layer input ``[B, S, hidden]``.
            positions: RoPE positions ``[B, S]`` (or broadcastable to it).

        Returns:
            ``(q [B, S, H, D], kv [B, S, D], qr [B, S, q_lora_rank])``, in ``x``'s dtype.
        """
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = _rms_normalize(q.float(), self.config.norm_eps).to(x.dtype)  # no weight
        q = self.rope(q, positions[..., None])
        kv = self.rope(self.kv_norm(self.wkv(x)), positions)
        return q, kv, qr

    def select_slots(self, scores: torch.Tensor, visible_count: torch.Tensor) -> torch.Tensor:
        """Indexer top-k over candidate slots ``0 .. N-1`` of each query.

        Candidates ``j >= visible_count`` are set to ``-inf`` first; the top
        ``k_eff = min(index_topk, N)`` are taken in descending-score order with the lower slot
        first on ties, and picks whose score is ``-inf`` become ``-1``.

        Args:
            scores: Index scores ``[B, S, N]``.
            visible_count: Visible slots per query, integer, broadcastable to ``[B, S]``.

        Returns:
            Slot ids ``[B, S, k_eff]`` (int64, ``-1`` = none).
        """
        n = scores.shape[-1]
        hidden = torch.arange(n, device=scores.device) >= visible_count[..., None]
        masked = scores.float().masked_fill(hidden, float("-inf"))
        values, ids = deterministic_topk(masked, min(self.config.index_topk, n))
        return torch.where(torch.isneginf(values), -1, ids)

    def attend(self, q: torch.Tensor, kv_pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Sparse attention with this layer's sink (``attn_sink``, ``None``: no sink) and scale
        ``head_dim**-0.5``.

        Args:
            q: Queries ``[B, S, H, D]``.
            kv_pool: KV pool ``[B, P, D]``.
            idx: Pool rows per query ``[B, S, K]``, ``-1`` = empty.

        Returns:
            ``[B, S, H, D]`` in ``q``'s dtype.
        """
        return sparse_attention_smallop(q, kv_pool, idx, self.attn_sink, self.softmax_scale)

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE at the query positions, then the grouped output projection.

        Args:
            o: Attention output ``[B, S, H, D]``.
            positions: Query RoPE positions ``[B, S]`` (or broadcastable to it).

        Returns:
            ``[B, S, hidden]``.
        """
        o = self.rope(o, positions[..., None], inverse=True)
        groups, rank = self.config.o_groups, self.config.o_lora_rank
        o = o.flatten(2).unflatten(-1, (groups, -1))  # [B, S, G, H*D/G]
        wo_a = self.wo_a.weight.view(groups, rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.wo_b(o.flatten(2))

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the layer on padded or packed input.

        In training, a CSA layer (r = 4) also computes the indexer KL loss, keeps it in
        :attr:`indexer_loss` and attaches ``indexer_loss_coeff * indexer_loss`` to the output's
        backward (see :mod:`hp_cp_torch.model.indexer_loss`).

        Args:
            x: Padded ``[B, S, hidden]``, or packed ``[T, hidden]`` (also ``[1, T, hidden]``)
                when ``cu_seqlens`` is given.
            position_ids: RoPE positions, ``[B, S]`` or ``[S]`` (padded; default
                ``arange(S)``), or ``[T]`` (packed; default restarts at 0 in each document).
            cu_seqlens: Packed document boundaries ``[n_docs + 1]``, from 0 to ``T``. Each
                document is its own sequence: RoPE, window, compression grid and slot
                visibility restart at its first row.
            loss_mask: Rows that count in the indexer loss (``[B, S]`` / ``[S]`` padded,
                ``[T]`` packed; nonzero = counts). Padding rows given 0 count nowhere: not in
                the sum, not in the mean's divisor. Default: every row counts.

        Returns:
            Output with the shape of ``x``.
        """
        if cu_seqlens is None:
            if x.dim() != 3:
                raise ValueError(f"padded input must be [B, S, hidden], got {tuple(x.shape)}")
            batch, seq = x.shape[:2]
            if position_ids is None:
                position_ids = torch.arange(seq, device=x.device)
            out, kl = self._forward_padded(x, position_ids.expand(batch, seq))
        else:
            out, kl = self._forward_packed(x, position_ids, cu_seqlens)
        return self._finish_indexer_loss(out, kl, loss_mask)

    def _finish_indexer_loss(
        self, out: torch.Tensor, kl: torch.Tensor | None, loss_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Mean the per-row KL over the rows that count, keep it, attach it to ``out``.

        Set once, after the loss: a recomputation in backward (``checkpoint(...,
        use_reentrant=False)`` stops once it has what backward needs) leaves the forward's
        value."""
        if kl is None:
            self.indexer_loss = None
            return out
        keep = torch.ones_like(kl) if loss_mask is None else loss_mask.reshape(kl.shape) != 0
        weight = keep.to(kl.dtype)
        loss = (kl * weight).sum() / weight.sum().clamp(min=1)
        self.indexer_loss = loss.detach()
        return attach_indexer_loss(out, loss, self.config.indexer_loss_coeff)

    @property
    def computes_indexer_loss(self) -> bool:
        """Whether a forward computes the indexer loss: a CSA layer in training mode."""
        return self.indexer is not None and self.training

    def _forward_packed(
        self, x: torch.Tensor, position_ids: torch.Tensor | None, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        squeeze = x.dim() == 3
        if squeeze:
            if x.shape[0] != 1:
                raise ValueError(
                    f"packed input must be [T, hidden] or [1, T, hidden], got {tuple(x.shape)}"
                )
            x = x[0]
            position_ids = None if position_ids is None else position_ids.reshape(-1)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != x.shape[0] or bounds != sorted(bounds):
            raise ValueError(f"cu_seqlens must rise from 0 to T={x.shape[0]}, got {bounds}")
        outs, kls = [], []
        for start, end in pairwise(bounds):
            if start == end:
                continue
            pos = (
                torch.arange(end - start, device=x.device)
                if position_ids is None
                else position_ids[start:end]
            )
            out, kl = self._forward_padded(x[None, start:end], pos[None])
            outs.append(out[0])
            kls.append(kl)
        out = torch.cat(outs) if outs else x.new_zeros(0, self.config.hidden_size)
        kl = torch.cat([k[0] for k in kls]) if kls and kls[0] is not None else None
        return (out[None] if squeeze else out), kl

    def _forward_padded(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Output ``[B, S, hidden]`` and, when the loss is computed, per-row KL ``[B, S]``."""
        batch, seq, _ = x.shape
        q, kv, qr = self.project(x, positions)
        window = window_indices(seq, self.window_size, x.device).expand(batch, -1, -1)
        idx, pool, kl = window, kv, None
        r = self.compress_ratio
        if self.compressor is not None:
            pool = torch.cat((kv, self.compressor(x)), dim=1)  # slot j at row seq + j
            if self.indexer is not None:
                slots, student = self._indexer_slots(x, qr, positions)
            else:
                slots = hca_slot_indices(seq, r, x.device).expand(batch, -1, -1)
            slot_cols = torch.where(slots >= 0, slots + seq, -1)
            idx = torch.cat((window, slot_cols), dim=-1)
            if self.computes_indexer_loss:
                kl = indexer_kl_rows(
                    q, pool, window, slot_cols, student, self.attn_sink, self.softmax_scale
                )
        o = self.attend(q, pool, idx)
        return self.output(o, positions), kl

    def _indexer_slots(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's picks ``[B, S, min(index_topk, S // 4)]`` (slot ids, -1 = none) and
        their scores recomputed with gradient (the loss's student)."""
        assert self.indexer is not None
        x, qr = x.detach(), qr.detach()  # Megatron: no gradient from attention into the indexer
        keys = self.indexer.compressor(x)
        q_idx, weights = self.indexer.queries(qr, positions), self.indexer.weights(x)
        with torch.no_grad():
            scores = self.indexer.scores(q_idx, weights, keys)
        visible = (torch.arange(x.shape[1], device=x.device) + 1) // self.compress_ratio
        slots = self.select_slots(scores, visible)
        return slots, indexer_scores_at(q_idx, weights, keys, slots)
