"""``SparseLlama``: a small Llama-style decoder converted to DeepSeek Sparse Attention (DSA),
written without hp_cp.

It is shaped unlike the DSA models hp_cp ships (latent attention): each ``SparseAttention``
layer is grouped-query attention (8 query heads over 2 KV heads, separate ``k_proj`` and
``v_proj``, per-head ``q_norm`` / ``k_norm``), roped with the ``(cos, sin)`` table the
decoder's ``Rotary`` module makes once per call and hands every layer. A lightning indexer
(``Indexer``) scores the tokens and ``torch.topk`` keeps the ``topk`` best: query ``t``
attends to those of the tokens ``0 .. t`` of its document (itself included), and to nothing
else: no window, no sink. A layer built with ``indexer=False`` has no indexer and reuses the
picks of the layer before it (the layers hand them on as their second output). The indexer
reads the layer input detached and learns from its own KL loss: KL(teacher || student) over
each query's picks, the teacher the attention's weights summed over heads and normalised,
the student the log-softmax of the indexer's scores, a mean over all query rows; it is
attached to the layer output with weight ``loss_coeff`` (its value kept as
``layer.indexer_loss``). With ``cu_seqlens`` (packed documents, batch 1) each document is
its own sequence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope ``x [B, n, heads, D]`` with ``cos, sin [B or 1, n, D]`` (Llama's half split)."""
    return x * cos[:, :, None] + rotate_half(x) * sin[:, :, None]


class Rotary(nn.Module):
    """The decoder's rotary table: ``(cos, sin)`` ``[B, n, head_dim]`` of ``position_ids``."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()


class Indexer(nn.Module):
    """The lightning indexer: ``score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])``."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.weights_proj = nn.Linear(dim, heads, bias=False)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Roped queries ``[B, n, heads, head_dim]`` and head weights ``[B, n, heads]``."""
        q = self.wq(x).view(*x.shape[:2], self.heads, self.head_dim)
        weights = self.weights_proj(x) * (self.heads * self.head_dim) ** -0.5
        return apply_rotary(q, cos, sin), weights

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Roped keys ``[B, n, head_dim]``."""
        k = self.k_norm(self.wk(x))[:, :, None]
        return apply_rotary(k, cos, sin)[:, :, 0]

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``q [B, l, h, d]``, ``w [B, l, h]``, ``keys [B, s, d]`` -> ``[B, l, s]`` (fp32)."""
        logits = torch.einsum("blhd,bsd->blhs", q.float(), keys.float()).relu()
        return torch.einsum("blhs,blh->bls", logits, w.float())


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; its backward seeds ``loss`` with ``coeff`` (the indexer's gradient)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, coeff: float) -> torch.Tensor:
        ctx.coeff, ctx.like = coeff, loss
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, torch.full_like(ctx.like, ctx.coeff), None


class SparseAttention(nn.Module):
    def __init__(
        self,
        dim: int = 32,
        heads: int = 8,
        kv_heads: int = 2,
        head_dim: int = 8,
        indexer: bool = True,
        index_heads: int = 4,
        topk: int = 4,
        loss_coeff: float | None = 0.5,
    ) -> None:
        super().__init__()
        self.dim, self.heads, self.kv_heads, self.head_dim = dim, heads, kv_heads, head_dim
        self.topk, self.loss_coeff = topk, loss_coeff
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.indexer = Indexer(dim, index_heads, head_dim) if indexer else None
        self.indexer_loss: torch.Tensor | None = None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Roped queries ``[B, n, heads, head_dim]``, keys and values ``[B, n, kv_heads,
        head_dim]``."""
        batch, n = x.shape[:2]
        q = self.q_norm(self.q_proj(x).view(batch, n, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, n, self.kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor | None = None,
        picks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, S, dim], picks [B, S, topk])``: the picks are token ids (of the
        document when packed; ``-1``: none), the ones this layer made or ``picks``."""
        cos, sin = position_embeddings
        bounds = [0, hidden.shape[1]] if cu_seqlens is None else [int(b) for b in cu_seqlens]
        outs, made, kls = [], [], []
        for a, b in zip(bounds[:-1], bounds[1:]):  # packed: every document alone
            doc_picks = None if picks is None else picks[:, a:b]
            out, doc_picks, kl = self._attend(hidden[:, a:b], cos[:, a:b], sin[:, a:b], doc_picks)
            outs.append(out)
            made.append(doc_picks)
            kls.append(kl)
        out = torch.cat(outs, dim=1)
        if self.indexer is not None and self.loss_coeff is not None:
            loss = torch.cat(kls, dim=1).mean()
            self.indexer_loss = loss.detach()
            out = _AttachLoss.apply(out, loss, float(self.loss_coeff))
        return out, torch.cat(made, dim=1)

    def _attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, picks: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One sequence's ``(out, picks, per-row KL [B, n] or None)``."""
        batch, n = x.shape[:2]
        q, k, v = self.project(x, cos, sin)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        if self.indexer is not None:
            q_i, w_i = self.indexer.queries(x.detach(), cos, sin)
            k_i = self.indexer.keys(x.detach(), cos, sin)
            with torch.no_grad():
                scores = self.indexer.scores(q_i, w_i, k_i).masked_fill(~causal, float("-inf"))
                top = scores.topk(min(self.topk, n), dim=-1)
                picks = torch.where(top.values > float("-inf"), top.indices, -1)
                picks = F.pad(picks, (0, self.topk - picks.shape[-1]), value=-1)
        chosen = torch.zeros(batch, n, n + 1, dtype=torch.bool, device=x.device)
        chosen = chosen.scatter(-1, torch.where(picks >= 0, picks, n), True)[..., :n]
        group = self.heads // self.kv_heads
        keys, values = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        logits = torch.einsum("bthd,bshd->bths", q, keys) * self.scale
        logits = logits.masked_fill(~chosen[:, :, None, :], float("-inf"))
        probs = logits.float().softmax(dim=-1)
        o = torch.einsum("bths,bshd->bthd", probs.to(values.dtype), values)
        kl = None
        if self.indexer is not None and self.loss_coeff is not None:
            with torch.no_grad():
                target = probs.sum(dim=2)
                target = target / target.sum(dim=-1, keepdim=True)
            student = self.indexer.scores(q_i, w_i, k_i).masked_fill(~chosen, float("-inf"))
            log_student = torch.where(chosen, student.log_softmax(dim=-1), 0.0)
            kl = (torch.xlogy(target, target) - target * log_student).sum(dim=-1)  # [B, n]
        return self.o_proj(o.flatten(2)), picks, kl


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, indexer: bool, **attn: Any) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(dim, eps=1e-6)
        self.self_attn = SparseAttention(dim, indexer=indexer, **attn)
        self.post_norm = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = MLP(dim, 2 * dim)

    def forward(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor | None = None,
        picks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.input_norm(hidden)
        attn, picks = self.self_attn(normed, position_embeddings, cu_seqlens, picks)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_norm(hidden)), picks


class SparseLlama(nn.Module):
    """Embedding, decoder layers (``indexers[i]``: layer ``i`` has its own indexer, else it
    reuses the previous layer's picks), norm, LM head: ``logits [B, S, vocab]``."""

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        indexers: tuple[bool, ...] = (True, False, True),
        head_dim: int = 8,
        **attn: Any,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary = Rotary(head_dim)
        self.layers = nn.ModuleList(
            DecoderLayer(dim, own, head_dim=head_dim, **attn) for own in indexers
        )
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.gradient_checkpointing = False

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:  # per document when packed
            bounds = [0, input_ids.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
            position_ids = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
            position_ids = position_ids[None].to(input_ids.device)
        position_embeddings = self.rotary(position_ids)  # once per call, for every layer
        hidden, picks = self.embed(input_ids), None
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                hidden, picks = checkpoint(
                    layer, hidden, position_embeddings, cu_seqlens, picks, use_reentrant=False
                )
            else:
                hidden, picks = layer(hidden, position_embeddings, cu_seqlens, picks)
        return self.lm_head(self.norm(hidden))
