"""``PooledAttention``: a DeepSeek-V4-style sparse attention layer written without hp_cp.

It is shaped unlike the models hp_cp ships: one fused projection ``to_qkv`` makes every
head's query and the one shared KV head; the compressors are ``Pooler`` modules called as
``pooler(x, slot_positions)`` (the positions of the slots they make, a tensor); the indexer
(``picker``) has its own queries from the layer input; the layer is called as
``layer(hidden, pos=None, doc_bounds=None)``. Query ``t`` attends, with a per-head sink, to
the keys of its window (``t - window < i <= t``) and to the compressed slots ``j`` it can see
(``(j + 1) * ratio <= t + 1``): all of them at ratio 128, the indexer's ``topk`` best at
ratio 4. With ``doc_bounds`` (packed documents) each document is its own sequence.
"""

from __future__ import annotations

import torch
from torch import nn


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate the halves of ``x [..., D]`` by ``pos`` (broadcast to ``x.shape[:-1]``)."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = pos.to(torch.float32)[..., None] * freqs
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Pooler(nn.Module):
    """Gated pooling of each block of ``ratio`` rows into one slot, roped at its position."""

    def __init__(self, dim: int, out_dim: int, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.values = nn.Linear(dim, out_dim, bias=False)
        self.gates = nn.Linear(dim, out_dim, bias=False)
        self.block_bias = nn.Parameter(torch.randn(ratio, out_dim) * 0.1)

    def forward(self, x: torch.Tensor, slot_positions: torch.Tensor) -> torch.Tensor:
        """``x [B, n, dim]`` -> ``[B, n // ratio, out_dim]`` (trailing rows dropped)."""
        batch, m = x.shape[0], int(slot_positions.shape[0])
        rows = x[:, : m * self.ratio]
        out_dim = self.block_bias.shape[-1]
        values = self.values(rows).view(batch, m, self.ratio, out_dim)
        gates = self.gates(rows).view(batch, m, self.ratio, out_dim) + self.block_bias
        pooled = (values * gates.softmax(dim=2)).sum(dim=2)
        return rope(pooled, slot_positions)


class Picker(nn.Module):
    """The indexer: ``sum_h w[t, h] * relu(q[t, h] . k[j])`` over compressed keys."""

    def __init__(self, dim: int, heads: int, head_dim: int, ratio: int, topk: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.topk = heads, head_dim, topk
        self.query = nn.Linear(dim, heads * head_dim, bias=False)
        self.head_weights = nn.Linear(dim, heads, bias=False)
        self.pooler = Pooler(dim, head_dim, ratio)

    def queries(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.query(x).view(*x.shape[:2], self.heads, self.head_dim)
        return rope(q, pos[..., None]), self.head_weights(x)

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``q [B, l, h, d]``, ``w [B, l, h]``, ``keys [B, s, d]`` -> ``[B, l, s]``."""
        logits = torch.einsum("blhd,bsd->blhs", q.float(), keys.float()).relu()
        return torch.einsum("blhs,blh->bls", logits, w.float())


class PooledAttention(nn.Module):
    def __init__(
        self,
        dim: int = 32,
        heads: int = 2,
        head_dim: int = 16,
        window: int = 16,
        ratio: int = 4,
        topk: int = 3,
    ) -> None:
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, head_dim
        self.window, self.ratio, self.topk = window, ratio, topk
        self.scale = head_dim**-0.5
        self.to_qkv = nn.Linear(dim, (heads + 1) * head_dim, bias=False)
        self.sink = nn.Parameter(torch.randn(heads) * 0.5)
        self.pooler = Pooler(dim, head_dim, ratio) if ratio else None
        self.picker = Picker(dim, 2, 8, ratio, topk) if ratio == 4 else None
        self.to_out = nn.Linear(heads * head_dim, dim, bias=False)

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``[B, n, heads, head_dim]`` and the shared KV head ``[B, n, head_dim]``."""
        q, kv = self.to_qkv(x).split([self.heads * self.head_dim, self.head_dim], dim=-1)
        q = q.view(*x.shape[:2], self.heads, self.head_dim)
        return rope(q, pos[..., None]), rope(kv, pos)

    def forward(self, hidden: torch.Tensor, pos=None, doc_bounds=None) -> torch.Tensor:
        if doc_bounds is not None:  # packed: every document alone
            bounds = [int(b) for b in doc_bounds]
            docs = [hidden[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            return torch.cat([self._attend(d, torch.arange(d.shape[1])) for d in docs], dim=1)
        return self._attend(hidden, torch.arange(hidden.shape[1]) if pos is None else pos)

    def _attend(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        batch, n = x.shape[:2]
        pos = pos.reshape(-1, n).expand(batch, -1)
        q, kv = self.project(x, pos)
        t = torch.arange(n)
        logits = torch.einsum("bthd,bid->bthi", q, kv) * self.scale
        window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - self.window)
        logits = logits.masked_fill(~window[None, :, None, :], float("-inf"))
        values = kv
        if self.ratio:
            m = n // self.ratio
            slots = self.pooler(x, torch.arange(m) * self.ratio)
            seen = (torch.arange(m)[None, :] + 1) * self.ratio <= t[:, None] + 1  # [n, m]
            seen = seen[None].expand(batch, -1, -1)
            if self.picker is not None and m:
                with torch.no_grad():
                    q_i, w_i = self.picker.queries(x, pos)
                    keys = self.picker.pooler(x, torch.arange(m) * self.ratio)
                    scores = self.picker.scores(q_i, w_i, keys).masked_fill(~seen, float("-inf"))
                    top = scores.topk(min(self.topk, m), dim=-1)
                    chosen = torch.zeros_like(seen).scatter(-1, top.indices, top.values > -1e30)
                seen = seen & chosen
            slot_logits = torch.einsum("bthd,bjd->bthj", q, slots) * self.scale
            slot_logits = slot_logits.masked_fill(~seen[:, :, None, :], float("-inf"))
            logits = torch.cat([logits, slot_logits], dim=-1)
            values = torch.cat([kv, slots], dim=1)
        sink = self.sink.view(1, 1, -1, 1).expand(batch, n, -1, 1)
        probs = torch.cat([logits, sink], dim=-1).float().softmax(dim=-1)[..., :-1]
        o = torch.einsum("bthi,bid->bthd", probs.to(values.dtype), values)
        return self.to_out(o.flatten(2))


class PooledStack(nn.Module):
    """Layers of every ratio (0: window only, 4: with the indexer, 128), each residual."""

    def __init__(self, ratios: tuple[int, ...] = (0, 4, 128), **kw) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PooledAttention(ratio=r, **kw) for r in ratios)

    def forward(self, hidden: torch.Tensor, pos=None, doc_bounds=None) -> torch.Tensor:
        for layer in self.layers:
            hidden = hidden + layer(hidden, pos, doc_bounds)
        return hidden
