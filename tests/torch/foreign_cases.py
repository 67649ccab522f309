"""Foreign modules: attention cores written here from the DeepSeek V4 semantics alone, put
under CP only through the public API (``patch_torch_deepseek_v4_csa_forward``,
``DeepSeekV4CPConfig``, ``disable_cp``, the handle's ``shard`` / ``unshard``).

Nothing here imports the project's reference layer or kernels: the compressors, the
indexer, RoPE, RMSNorm and the three attention functions are this file's own, shaped the
way a user would write them, including the shapes that once deadlocked CP backward:

* :class:`ConcatSeqMajor`: sequence-major ``[S, B, N, D]``, key ``[S, B, 1, D]``;
  concatenates ``[ori_kv ; cmp_kv]`` values, masks invisible columns with ``-inf`` and
  softmaxes with the sink as an extra column. Its compressor returns ``x.new_zeros(0, B, d)``
  for fewer than r rows; the indexer (r = 4) is an attribute ``indexer.compressor``.
* :class:`CompressedFirst`: batch-major inside, key ``[S, B, D]``; computes the compressed
  branch first, then the window branch by gathering indices, and joins them with a
  log-sum-exp that includes the sink. Its compressor returns a fresh ``torch.zeros`` for
  empty input; passed to the patch explicitly, not read from attributes.
* :class:`SkipsEmptyCmp`: never touches ``cmp_kv`` (nor the indexer keys) when no query of
  the call sees a slot, and reads only the visible prefix otherwise. Its compressor returns a
  detached tensor for empty input.

Each case runs a module under CP on this rank's rows (forward and backward) and returns the
unsharded output, input gradients and summed parameter gradients; the test compares them
with the same module run on one device in the pytest process. Run through
``cases.job`` as the suite ``"foreign_cases:foreign_suite"``, one job per cp size, on a
default process group with a short timeout (:data:`PG_TIMEOUT_S`), so a hang fails in
seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_cp_core import DeepSeekV4CPConfig, disable_cp
from hp_cp_torch import patch_torch_deepseek_v4_csa_forward

PG_TIMEOUT_S = 20.0
"""Collective timeout of the suite's process group: a deadlock fails after this long."""

HIDDEN, HEADS, DIM, ROPE, QR = 16, 2, 16, 8, 12
IDX_HEADS, IDX_DIM, TOPK = 2, 8, 3


# ------------------------------------------------------------------------------ building blocks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE on the last :data:`ROPE` channels (half-split pairs); ``pos`` has ``x``'s leading
    shape without the channel dim, or broadcasts to it."""
    half = ROPE // 2
    freq = base ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = pos.to(torch.float32)[..., None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    keep, a, b = x[..., :-ROPE], x[..., -ROPE:-half], x[..., -half:]
    return torch.cat([keep, a * cos - b * sin, a * sin + b * cos], dim=-1)


class GatedPool(nn.Module):
    """A compressor ``(x [n, B, hidden], rope_pos_offset) -> [n // r, B, d]``, sequence-major.

    Slot j pools rows ``[j*r, (j+1)*r)`` with a per-channel softmax gate; for r = 4 it also
    reads the previous block through the first ``d`` channels (a missing predecessor is kv 0,
    score -inf). Then RMSNorm and RoPE at ``rope_pos_offset + j*r``.

    ``empty`` is what it returns for fewer than r rows: ``"new_zeros"``
    (``x.new_zeros(0, B, d)``), ``"fresh"`` (a new ``torch.zeros``, no graph) or
    ``"detached"`` (a projection of the empty input, detached).
    """

    def __init__(self, d: int, r: int, empty: str) -> None:
        super().__init__()
        self.d, self.r, self.empty = d, r, empty
        coff = 2 if r == 4 else 1
        self.wkv = nn.Linear(HIDDEN, coff * d, bias=False)
        self.wgate = nn.Linear(HIDDEN, coff * d, bias=False)
        self.ape = nn.Parameter(0.1 * torch.randn(r, coff * d))
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor, rope_pos_offset: int = 0) -> torch.Tensor:
        n, batch = x.shape[0], x.shape[1]
        slots, r, d = n // self.r, self.r, self.d
        if slots == 0:
            if self.empty == "new_zeros":
                return x.new_zeros(0, batch, d)
            if self.empty == "fresh":
                return torch.zeros(0, batch, d)
            return self.wkv(x[:0])[..., :d].detach()
        rows = x[: slots * r]
        kv = self.wkv(rows).view(slots, r, batch, -1)
        score = self.wgate(rows).view(slots, r, batch, -1) + self.ape[None, :, None, :]
        if r == 4:
            pad_kv = kv.new_zeros(1, r, batch, d)
            pad_score = score.new_full((1, r, batch, d), float("-inf"))
            kv = torch.cat(
                [torch.cat([pad_kv, kv[:-1, ..., :d]]), kv[..., d:]], dim=1
            )  # [slots, 2r, B, d]
            score = torch.cat([torch.cat([pad_score, score[:-1, ..., :d]]), score[..., d:]], dim=1)
        pooled = (score.softmax(dim=1) * kv).sum(dim=1)  # [slots, B, d]
        pos = rope_pos_offset + r * torch.arange(slots)
        return rotate(rms_norm(pooled, self.norm), pos[:, None])


class Indexer(nn.Module):
    """Lightning-indexer scores of local queries against every gathered key."""

    def __init__(self, empty: str) -> None:
        super().__init__()
        self.compressor = GatedPool(IDX_DIM, 4, empty)
        self.wq = nn.Linear(QR, IDX_HEADS * IDX_DIM, bias=False)
        self.weights = nn.Linear(HIDDEN, IDX_HEADS, bias=False)

    def scores(self, qr: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, t: torch.Tensor):
        """``[B, n, N]``: sum over heads of weight x ReLU(q . key)."""
        q = rotate(self.wq(qr).unflatten(-1, (IDX_HEADS, IDX_DIM)), t[:, None, None])
        logits = torch.einsum("nbhd,jbd->bnhj", q, keys).relu()
        return torch.einsum("bnhj,nbh->bnj", logits, self.weights(x) * IDX_HEADS**-0.5)


def pick_slots(
    indexer: Indexer | None,
    r: int,
    qr: torch.Tensor,
    x: torch.Tensor,
    keys: torch.Tensor | None,
    t: torch.Tensor,
    n_slots: int,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot ids [B, n, k], logit bonus [B, n, k])`` of the compressed columns of each query;
    ``-1`` marks an empty column. HCA: every slot in order; CSA: the indexer's top-k, and the
    picked score (scaled) is added to the attention logit so the indexer gets a gradient."""
    visible = (t + 1) // r  # slots j < visible are causal for query t
    slots = torch.arange(n_slots)
    if indexer is None:
        ids = torch.where(slots < visible[:, None], slots, -1).expand(batch, -1, -1)
        return ids, torch.zeros(ids.shape)
    score = indexer.scores(qr, x, keys, t)
    # ReLU makes exact ties (scores of 0); prefer the earlier slot, so that the pick does not
    # depend on how many slots the row holds (all of them on one device, fewer under CP)
    score = (score - 1e-3 * slots).masked_fill(slots >= visible[:, None], float("-inf"))
    k = min(TOPK, n_slots)
    values, ids = torch.topk(score, k, dim=-1)
    ok = torch.isfinite(values)
    return torch.where(ok, ids, -1), torch.where(ok, 0.1 * values, 0.0)


class _ForeignBase(nn.Module):
    """Parameters shared by the three modules: compressors, indexer, sink, output map."""

    empty = "new_zeros"

    def __init__(self, compress_ratio: int, window_size: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(5000 + seed)
        self.compress_ratio, self.window_size = compress_ratio, window_size
        self.cmp = GatedPool(DIM, compress_ratio, self.empty) if compress_ratio else None
        self.indexer = Indexer(self.empty) if compress_ratio == 4 else None
        self.sink = nn.Parameter(torch.randn(HEADS))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, query, key, x, qr):
        r = self.compress_ratio
        return self.attention_fn(
            query=query,
            ori_kv=key,
            x=x,
            qr=qr,
            pos_offset=0,
            cmp_kv_global=self.cmp(x, rope_pos_offset=0) if r else None,
            ori_halo_len=0,
            cmp_idx_global=self.indexer.compressor(x, rope_pos_offset=0) if r == 4 else None,
        )


class ConcatSeqMajor(_ForeignBase):
    """``[ori_kv ; cmp_kv]`` values, ``-inf`` masks, sink as an extra softmax column."""

    KEY_HEAD_DIM = True  # key [S, B, 1, D]

    @property
    def compressor(self) -> GatedPool | None:  # read by the patch from the module
        return self.cmp

    def attention_fn(
        self, *, query, ori_kv, x, qr, pos_offset, cmp_kv_global, ori_halo_len, cmp_idx_global
    ):
        kv = ori_kv.squeeze(2)  # [E, B, D]
        n, batch, e = query.shape[0], query.shape[1], kv.shape[0]
        t = pos_offset + torch.arange(n)
        key_pos = pos_offset - ori_halo_len + torch.arange(e)
        window = (key_pos[None] <= t[:, None]) & (key_pos[None] > t[:, None] - self.window_size)
        mask = window.expand(batch, n, e)
        bonus = torch.zeros(batch, n, e)
        values = kv
        if self.compress_ratio:
            n_slots = cmp_kv_global.shape[0]
            ids, extra = pick_slots(
                self.indexer, self.compress_ratio, qr, x, cmp_idx_global, t, n_slots, batch
            )
            onehot = torch.zeros(batch, n, n_slots + 1).scatter(-1, ids % (n_slots + 1), 1.0)
            cmp_mask = onehot[..., :n_slots].bool()
            cmp_bonus = torch.zeros(batch, n, n_slots + 1).scatter_add(
                -1, ids % (n_slots + 1), extra
            )
            mask = torch.cat([mask, cmp_mask], dim=-1)
            bonus = torch.cat([bonus, cmp_bonus[..., :n_slots]], dim=-1)
            values = torch.cat([kv, cmp_kv_global])  # [E + N, B, D]
        logits = torch.einsum("nbhd,mbd->bhnm", query, values) * DIM**-0.5 + bonus[:, None]
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        sink = self.sink[None, :, None, None].expand(batch, -1, n, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("bhnm,mbd->nbhd", probs, values)
        return self.wo(out)


class CompressedFirst(_ForeignBase):
    """Batch-major inside; compressed branch first, window by index gather, log-sum-exp join."""

    KEY_HEAD_DIM = False  # key [S, B, D]
    empty = "fresh"

    def attention_fn(
        self, *, query, ori_kv, x, qr, pos_offset, cmp_kv_global, ori_halo_len, cmp_idx_global
    ):
        q = query.transpose(0, 1)  # [B, n, H, D]
        batch, n = q.shape[0], q.shape[1]
        t = pos_offset + torch.arange(n)
        parts_logit, parts_value = [], []
        if self.compress_ratio:
            n_slots = cmp_kv_global.shape[0]
            ids, extra = pick_slots(
                self.indexer, self.compress_ratio, qr, x, cmp_idx_global, t, n_slots, batch
            )
            ckv = cmp_kv_global.transpose(0, 1)  # [B, N, D]
            picked = torch.stack([ckv[b][ids[b].clamp_min(0)] for b in range(batch)])
            s = torch.einsum("bnhd,bnkd->bnhk", q, picked) * DIM**-0.5 + extra[:, :, None]
            parts_logit.append(s.masked_fill((ids < 0)[:, :, None], float("-inf")))
            parts_value.append(picked)
        kv = ori_kv.transpose(0, 1)  # [B, E, D]
        first = pos_offset - ori_halo_len
        rows = t[:, None] - self.window_size + 1 + torch.arange(self.window_size)  # global
        valid = rows >= 0
        local = (rows - first).clamp_min(0)
        win = kv[:, local]  # [B, n, W, D]
        s = torch.einsum("bnhd,bnkd->bnhk", q, win) * DIM**-0.5
        parts_logit.append(s.masked_fill(~valid[None, :, None], float("-inf")))
        parts_value.append(win)
        logits = torch.cat(parts_logit, dim=-1)  # [B, n, H, K]
        values = torch.cat(parts_value, dim=2)  # [B, n, K, D]
        sink = self.sink[None, None, :, None].expand(batch, n, -1, 1)
        lse = torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1, keepdim=True)
        out = torch.einsum("bnhk,bnkd->bnhd", torch.exp(logits - lse), values)
        return self.wo(out).transpose(0, 1)


class SkipsEmptyCmp(_ForeignBase):
    """Reads only the visible prefix of ``cmp_kv``; no visible slot: never touches it."""

    KEY_HEAD_DIM = True
    empty = "detached"

    @property
    def compressor(self) -> GatedPool | None:
        return self.cmp

    def attention_fn(
        self, *, query, ori_kv, x, qr, pos_offset, cmp_kv_global, ori_halo_len, cmp_idx_global
    ):
        kv = ori_kv.reshape(ori_kv.shape[0], ori_kv.shape[1], DIM)  # [E, B, 1, D] or [E, B, D]
        n, batch, e = query.shape[0], query.shape[1], kv.shape[0]
        t = pos_offset + torch.arange(n)
        key_pos = pos_offset - ori_halo_len + torch.arange(e)
        window = (key_pos[None] <= t[:, None]) & (key_pos[None] > t[:, None] - self.window_size)
        scores = torch.einsum("nbhd,ebd->bhne", query, kv) * DIM**-0.5
        scores = scores.masked_fill(~window[None, None], float("-inf"))
        values = kv.transpose(0, 1)[:, None]  # [B, 1, E, D]
        r = self.compress_ratio
        n_visible = int((t[-1] + 1) // r) if r and n else 0
        if n_visible > 0:  # only then does this call read cmp_kv (and the indexer keys)
            ckv = cmp_kv_global[:n_visible]
            keys = None if cmp_idx_global is None else cmp_idx_global[:n_visible]
            ids, extra = pick_slots(self.indexer, r, qr, x, keys, t, n_visible, batch)
            hit = torch.zeros(batch, n, n_visible + 1).scatter(-1, ids % (n_visible + 1), 1.0)
            bonus = torch.zeros(batch, n, n_visible + 1).scatter_add(
                -1, ids % (n_visible + 1), extra
            )
            c = torch.einsum("nbhd,jbd->bhnj", query, ckv) * DIM**-0.5 + bonus[:, None, :, :-1]
            c = c.masked_fill(~hit[:, None, :, :-1].bool(), float("-inf"))
            scores = torch.cat([scores, c], dim=-1)
            values = torch.cat([values, ckv.transpose(0, 1)[:, None]], dim=2)
        sink = self.sink[None, :, None, None]
        m = torch.maximum(scores.amax(-1, keepdim=True), sink)
        p = torch.exp(scores - m)
        out = (
            torch.einsum("bhne,bxed->nbhd", p, values)
            / (p.sum(-1) + torch.exp(sink - m)[..., 0]).permute(2, 0, 1)[..., None]
        )
        return self.wo(out)


class TwoLayers(nn.Module):
    """:class:`ConcatSeqMajor`, then :class:`SkipsEmptyCmp` on its output: two modules,
    each patched on its own (two handles), the second's backward feeding the first's."""

    KEY_HEAD_DIM = True

    def __init__(self, compress_ratio: int, window_size: int, seed: int) -> None:
        super().__init__()
        self.first = ConcatSeqMajor(compress_ratio, window_size, seed)
        self.second = SkipsEmptyCmp(compress_ratio, window_size, seed + 1)

    def forward(self, query, key, x, qr):
        hidden = self.first(query, key, x, qr)
        return self.second(hidden, hidden.mean(2, keepdim=True), x, qr)


MODULES: dict[str, type[nn.Module]] = {
    "concat": ConcatSeqMajor,
    "cmpfirst": CompressedFirst,
    "skipempty": SkipsEmptyCmp,
    "twolayers": TwoLayers,
}


# ------------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class ForeignCase:
    """One module under CP. ``S`` global rows of a padded batch of 2 (sequence-major), or
    with ``docs`` (document lengths summing to ``S``) one packed stream (batch 1) passed with
    ``cu_seqlens``."""

    module: str
    cp: int
    r: int
    S: int
    window: int = 16
    layout: str = "contiguous"
    seed: int = 0
    docs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert not self.docs or sum(self.docs) == self.S, (self.docs, self.S)

    @property
    def name(self) -> str:
        lay = "lb" if self.layout == "load_balanced" else "contig"
        docs = f"-docs{'_'.join(map(str, self.docs))}" if self.docs else ""
        return f"{self.module}-cp{self.cp}-r{self.r}-W{self.window}-S{self.S}-{lay}{docs}"

    @property
    def batch(self) -> int:
        return 1 if self.docs else 2

    @property
    def cu_seqlens(self) -> list[int] | None:
        """The packed document boundaries, ``None`` when padded."""
        if not self.docs:
            return None
        return [0, *(int(c) for c in torch.tensor(self.docs).cumsum(0))]

    @property
    def local(self) -> int:
        return self.S // self.cp


def build_module(case: ForeignCase) -> nn.Module:
    return MODULES[case.module](case.r, case.window, case.seed)


def make_inputs(case: ForeignCase) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(6000 + case.seed)
    S, B = case.S, case.batch
    key = (S, B, 1, DIM) if MODULES[case.module].KEY_HEAD_DIM else (S, B, DIM)
    shapes = [(S, B, HEADS, DIM), key, (S, B, HIDDEN), (S, B, QR)]
    return [torch.randn(s, generator=gen) for s in shapes], torch.randn(
        S, B, HEADS, DIM, generator=gen
    )


def patch(module: nn.Module, case: ForeignCase) -> list[Any]:
    """Patch through the public API: attributes read from the module, or passed explicitly.
    Returns the handles (one per patched module)."""
    if isinstance(module, TwoLayers):
        return [*patch(module.first, case), *patch(module.second, case)]
    config = DeepSeekV4CPConfig(layout=case.layout)
    if isinstance(module, CompressedFirst):
        r = case.r
        handle = patch_torch_deepseek_v4_csa_forward(
            module,
            cp_mesh=None,
            config=config,
            compressor=module.cmp if r else None,
            indexer_compressor=module.indexer.compressor if r == 4 else None,
            attention_fn=module.attention_fn,
            compress_ratio=r,
            window_size=case.window,
        )
        return [handle]
    return [patch_torch_deepseek_v4_csa_forward(module, cp_mesh=None, config=config)]


def _loss(out: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (out * g).sum()


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad.detach()


def run_cp(case: ForeignCase) -> dict:
    """This rank's rows under CP; rank 0 returns everything unsharded / summed."""
    module = build_module(case)
    inputs, g = make_inputs(case)
    handles = patch(module, case)
    handle = handles[0]
    try:
        local = [handle.shard(t, 0).requires_grad_(True) for t in inputs]
        if case.docs:
            out = module(*local, cu_seqlens=torch.tensor(case.cu_seqlens))
        else:
            out = module(*local)
        params = list(module.parameters())
        grads = torch.autograd.grad(
            _loss(out, handle.shard(g, 0)), [*local, *params], allow_unused=True
        )
        full = handle.unshard(out.detach(), 0)
        gin = [handle.unshard(_or_zeros(gr, t), 0) for gr, t in zip(grads, local)]
        pgrads = []
        for gr, p in zip(grads[len(local) :], params):
            total = _or_zeros(gr, p).clone()
            dist.all_reduce(total)
            pgrads.append(total)
        rank = handle.cp_rank
    finally:
        for h in handles:
            disable_cp(h)
    if rank != 0:
        return {"cp_rank": rank}
    return {"cp_rank": rank, "out": full, "gin": gin, "pgrads": pgrads}


@functools.cache
def single_device(case: ForeignCase) -> dict:
    """The same module, weights and inputs on one device (the pytest process); packed: the
    module on each document alone, the outputs concatenated."""
    module = build_module(case)
    inputs, g = make_inputs(case)
    inputs = [t.requires_grad_(True) for t in inputs]
    if case.docs:
        cu = case.cu_seqlens
        spans = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]
        out = torch.cat([module(*(t[a:b] for t in inputs)) for a, b in spans])
    else:
        out = module(*inputs)
    params = list(module.parameters())
    grads = torch.autograd.grad(_loss(out, g), [*inputs, *params], allow_unused=True)
    names = [n for n, _ in module.named_parameters()]
    return {
        "out": out.detach(),
        "gin": grads[: len(inputs)],
        "pgrads": grads[len(inputs) :],
        "names": names,
    }


def foreign_cases(world: int) -> list[ForeignCase]:
    """The cases of one cp size (cp = world): padded, then packed."""
    return [*padded_cases(world), *packed_cases(world)]


def padded_cases(world: int) -> list[ForeignCase]:
    """The padded cases of one cp size."""
    cp = world
    if cp == 4:
        return [
            # the reproducer (L = 96 < r: rank 0 owns no slot and gets no halo),
            # with each of the three modules
            ForeignCase("concat", 4, 128, 384, window=64),
            ForeignCase("cmpfirst", 4, 128, 384, window=64),
            ForeignCase("skipempty", 4, 128, 384, window=64),
            ForeignCase("skipempty", 4, 128, 384, window=64, layout="load_balanced"),
            # r = 4 with an indexer, L = 2 < r: rank 0's queries see no slot, owns none
            ForeignCase("concat", 4, 4, 8),
            ForeignCase("skipempty", 4, 4, 16, layout="load_balanced"),
            ForeignCase("cmpfirst", 4, 4, 24, window=8, layout="load_balanced"),
            # L < W - 1, window only
            ForeignCase("cmpfirst", 4, 0, 24, layout="load_balanced"),
            # two patched modules in a row (two handles)
            ForeignCase("twolayers", 4, 128, 384, window=64),
        ]
    if cp == 2:
        return [
            ForeignCase("concat", 2, 128, 200, window=64),  # L = 100 < r
            ForeignCase("cmpfirst", 2, 128, 200, window=64, layout="load_balanced"),
            ForeignCase("skipempty", 2, 4, 6),  # L = 3 < r: rank 0 owns no slot
            ForeignCase("cmpfirst", 2, 4, 6),
            ForeignCase("concat", 2, 4, 12, layout="load_balanced"),
            ForeignCase("skipempty", 2, 0, 12, layout="load_balanced"),
            ForeignCase("twolayers", 2, 4, 8, layout="load_balanced"),
        ]
    if cp == 3:
        return [
            ForeignCase("skipempty", 3, 128, 300, window=64),  # rank 0 owns no slot
            ForeignCase("concat", 3, 128, 300, window=64, layout="load_balanced"),
            ForeignCase("cmpfirst", 3, 4, 6),
            ForeignCase("concat", 3, 4, 12, layout="load_balanced"),
            ForeignCase("skipempty", 3, 4, 18, window=8, layout="load_balanced"),
        ]
    if cp == 8:  # 8 processes on 2 cores: a short list
        return [
            ForeignCase("concat", 8, 128, 384, window=64),  # L = 48: ranks 0, 1 own none
            ForeignCase("skipempty", 8, 4, 16, layout="load_balanced"),
            ForeignCase("cmpfirst", 8, 128, 320, window=16, layout="load_balanced"),
        ]
    return []


def packed_cases(world: int) -> list[ForeignCase]:
    """Packed cases of one cp size: documents shorter than the window and than r (and
    empty), documents spanning several ranks, ranks holding only the tail of one."""
    lb = "load_balanced"
    P = ForeignCase
    return {
        2: [
            P("concat", 2, 4, 32, window=8, docs=(3, 21, 8)),
            P("cmpfirst", 2, 128, 256, window=64, layout=lb, docs=(130, 70, 56)),
            P("skipempty", 2, 4, 24, layout=lb, docs=(5, 0, 19)),
        ],
        3: [
            P("skipempty", 3, 4, 36, layout=lb, docs=(2, 25, 9)),
            P("concat", 3, 128, 300, window=32, docs=(200, 100)),  # rank 1: doc 0's tail
            P("cmpfirst", 3, 4, 30, window=8, docs=(7, 23)),
        ],
        4: [
            P("cmpfirst", 4, 4, 32, window=8, docs=(5, 27)),  # rank 3: doc 1's tail only
            P("skipempty", 4, 4, 32, layout=lb, docs=(3, 13, 1, 15)),
            P("concat", 4, 128, 384, window=64, docs=(150, 90, 144)),
            P("concat", 4, 4, 48, window=8, layout=lb, docs=(11, 30, 7)),
            P("skipempty", 4, 0, 32, layout=lb, docs=(9, 23)),
        ],
        8: [
            P("concat", 8, 4, 64, window=8, layout=lb, docs=(3, 40, 21)),
            P("skipempty", 8, 4, 64, docs=(2, 54, 8)),  # rank 6: doc 1's tail only
            P("cmpfirst", 8, 4, 64, layout=lb, docs=(6, 50, 8)),
        ],
    }.get(world, [])


def foreign_suite(world: int) -> dict[str, tuple[Callable, tuple]]:
    return {c.name: (run_cp, (c,)) for c in foreign_cases(world)}


def check(case: ForeignCase, got: dict, out_tol: float = 1e-5, grad_tol: float = 1e-5) -> None:
    """CP output, input and parameter gradients equal one device (fp32, relative to the
    largest reference entry)."""
    want = single_device(case)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        scale = b.abs().max().item() if b.numel() else 0.0
        diff = (a - b).abs().max().item() if b.numel() else 0.0
        return diff / scale if scale else diff

    assert rel(got["out"], want["out"]) <= out_tol, f"output error {rel(got['out'], want['out'])}"
    for name, a, b in zip(("query", "key", "x", "qr"), got["gin"], want["gin"]):
        b = _or_zeros(b, a)
        assert rel(a, b) <= grad_tol, f"gradient of {name}: error {rel(a, b):.3g}"
    for name, a, b in zip(want["names"], got["pgrads"], want["pgrads"]):
        b = _or_zeros(b, a)
        assert rel(a, b) <= grad_tol, f"gradient of {name}: error {rel(a, b):.3g}"
