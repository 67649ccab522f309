"""Tests of the single-device DeepSeek V4 attention reference and the small-op kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hp_cp_torch.attention import _topk_cpu, deterministic_topk
from hp_cp_torch.kernels.smallop import sparse_attention_smallop
from hp_cp_torch.reference import (
    DeepSeekV4Attention,
    DeepSeekV4AttentionConfig,
    hca_slot_indices,
    rope_frequencies,
    window_indices,
)

HIDDEN = 64
# A sequence length per ratio that gives several compressed slots (and, for r = 4, more
# visible slots than index_topk, so the top-k really selects).
SEQ = {0: 23, 4: 37, 128: 300}


def make_layer(ratio: int, seed: int = 0, **overrides: object) -> DeepSeekV4Attention:
    """Build a tiny layer: hidden 64, 4 heads of 32 (rope 8), window 8, top-k 4."""
    torch.manual_seed(seed)
    config = DeepSeekV4AttentionConfig(
        hidden_size=HIDDEN,
        n_heads=4,
        head_dim=32,
        rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        window_size=8,
        compress_ratio=ratio,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
    )
    return DeepSeekV4Attention(dataclasses.replace(config, **overrides))


def naive_layer(layer: DeepSeekV4Attention, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop over the key set of docs/semantics.md section 5 (one sequence)."""
    seq = x.shape[0]
    pos = torch.arange(seq)[None]
    q, kv, qr = layer.project(x[None], pos)
    r, window, topk = layer.compress_ratio, layer.window_size, layer.config.index_topk
    ckv = layer.compressor(x[None])[0] if layer.compressor is not None else None
    if layer.indexer is not None:
        ind = layer.indexer
        keys = ind.compressor(x[None])
        scores = ind.scores(ind.queries(qr, pos), ind.weights(x[None]), keys)[0]
    outs = []
    for t in range(seq):
        rows = [kv[0, u] for u in range(max(0, t - window + 1), t + 1)]
        if r == 128:
            rows += [ckv[j] for j in range(seq // r) if (j + 1) * r <= t + 1]
        elif r == 4:
            visible = range((t + 1) // 4)
            picked = sorted(visible, key=lambda j: (-scores[t, j].item(), j))[:topk]
            rows += [ckv[j] for j in picked]
        keys_t = torch.stack(rows)  # [n, D]
        logits = layer.softmax_scale * q[0, t] @ keys_t.T  # [H, n]
        with_sink = torch.cat((logits, layer.attn_sink[:, None]), dim=-1)
        outs.append(with_sink.softmax(-1)[:, :-1] @ keys_t)
    return layer.output(torch.stack(outs)[None], pos)[0]


# --------------------------------------------------------------------------- kernel


def test_sparse_attention_matches_dense_softmax_with_sink() -> None:
    torch.manual_seed(0)
    b, s, h, d, p, k = 2, 5, 3, 8, 7, 4
    q, kv, sink = torch.randn(b, s, h, d), torch.randn(b, p, d), torch.randn(h)
    idx = torch.randint(-1, p, (b, s, k))
    out = sparse_attention_smallop(q, kv, idx, sink, 0.3)
    for bi in range(b):
        for si in range(s):
            cols = [int(c) for c in idx[bi, si] if c >= 0]
            keys = kv[bi, cols]  # duplicates count twice, as in the kernel
            logits = torch.cat((0.3 * q[bi, si] @ keys.T, sink[:, None]), dim=-1)
            ref = logits.softmax(-1)[:, :-1] @ keys
            torch.testing.assert_close(out[bi, si], ref)


def test_sparse_attention_empty_rows_are_zero_with_finite_grads() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 3, 2, 4, requires_grad=True)
    kv = torch.randn(1, 5, 4, requires_grad=True)
    sink = torch.randn(2, requires_grad=True)
    idx = torch.tensor([[[-1, -1], [0, -1], [-1, -1]]])
    out = sparse_attention_smallop(q, kv, idx, sink, 0.5)
    assert torch.equal(out[0, 0], torch.zeros(2, 4))
    assert torch.equal(out[0, 2], torch.zeros(2, 4))
    out.square().sum().backward()
    for grad in (q.grad, kv.grad, sink.grad):
        assert grad is not None and grad.isfinite().all()
    assert torch.equal(q.grad[0, 0], torch.zeros(2, 4))
    # No columns at all: only the sink, so the output is 0.
    empty = sparse_attention_smallop(q, kv, idx[..., :0], sink, 0.5)
    assert torch.equal(empty, torch.zeros_like(q))


def test_deterministic_topk_breaks_ties_by_lower_index() -> None:
    inf = float("-inf")
    scores = torch.tensor([[1.0, 3.0, 3.0, inf, 3.0, inf, 1.0], [inf] * 7])
    values, ids = deterministic_topk(scores, 5)
    assert ids[0].tolist() == [1, 2, 4, 0, 6]
    assert values[0].tolist() == [3.0, 3.0, 3.0, 1.0, 1.0]
    assert ids[1].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("k", [0, 1, 3, 8, 13, 40])
@pytest.mark.parametrize(
    "kind", ["random", "ties", "neg_inf", "nan", "signed_zero", "bf16", "relu_zeros"]
)
def test_deterministic_topk_equals_a_stable_sort(k, kind) -> None:
    """Both of its paths (top-k threshold for small k, whole-row sort otherwise) give what a
    stable descending sort gives: values and indices, ties lowest index first."""
    g = torch.Generator().manual_seed(k)
    scores = torch.randn(3, 5, 40, generator=g)
    if kind == "ties":
        scores = torch.round(scores)
    if kind == "neg_inf":
        scores = torch.where(torch.rand(scores.shape, generator=g) < 0.8, float("-inf"), scores)
    if kind == "nan":
        scores[1, 2, 7] = float("nan")
        scores[1, 2, 9] = -float("nan")
        scores[0, 1, 3] = float("inf")
    if kind == "signed_zero":  # -0.0 and 0.0 are equal: a tie, lower index first
        scores = torch.where(scores > 0, 0.0, -0.0)
    if kind == "bf16":
        scores = torch.round(scores * 4).to(torch.bfloat16)
    if kind == "relu_zeros":  # an indexer row with negative weights: its best scores are 0
        sign = torch.where(torch.rand(3, 5, 1, generator=g) < 0.5, -1.0, 1.0)
        scores = scores.relu() * sign
    want_v, want_i = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, ids = deterministic_topk(scores, k)
    assert torch.equal(ids, want_i[..., :k])
    assert torch.equal(values.nan_to_num(), want_v[..., :k].nan_to_num())
    if 0 < k * 4 <= scores.shape[-1]:  # the host path of long rows, on these rows too
        values, ids = _topk_cpu(scores, k)
        assert torch.equal(ids, want_i[..., :k])
        assert torch.equal(values.nan_to_num(), want_v[..., :k].nan_to_num())


def test_select_slots_masks_invisible_and_breaks_ties_low() -> None:
    layer = make_layer(4)  # index_topk 4
    scores = torch.zeros(1, 3, 6)
    scores[0, 2, 5] = 1.0  # the best score, but slot 5 is invisible to every query
    visible = torch.tensor([0, 3, 6])
    ids = layer.select_slots(scores, visible)
    assert ids[0].tolist() == [[-1, -1, -1, -1], [0, 1, 2, -1], [5, 0, 1, 2]]
    assert layer.select_slots(scores[..., :2], visible).shape == (1, 3, 2)  # k_eff = N


# --------------------------------------------------------------------------- index helpers


def test_window_and_hca_indices() -> None:
    assert window_indices(5, 3).tolist() == [
        [0, -1, -1],
        [0, 1, -1],
        [0, 1, 2],
        [1, 2, 3],
        [2, 3, 4],
    ]
    hca = hca_slot_indices(9, 4)
    assert hca.tolist() == [[-1, -1]] * 3 + [[0, -1]] * 4 + [[0, 1]] * 2


def test_rope_frequencies_yarn() -> None:
    plain = rope_frequencies(64, 160000.0)
    yarn = rope_frequencies(64, 160000.0, factor=16.0, original_seq_len=65536)
    assert yarn[0] == plain[0]  # high frequencies are extrapolated
    torch.testing.assert_close(yarn[-1], plain[-1] / 16)  # low frequencies are interpolated
    assert torch.equal(rope_frequencies(64, 1e4, 16.0, 0), rope_frequencies(64, 1e4))


def test_rope_is_relative_and_invertible() -> None:
    layer = make_layer(0)
    torch.manual_seed(1)
    a, b = torch.randn(32), torch.randn(32)
    dots = [
        layer.rope(a, torch.tensor(p + 5)) @ layer.rope(b, torch.tensor(p)) for p in (0, 7, 100)
    ]
    torch.testing.assert_close(dots[0], dots[1])
    torch.testing.assert_close(dots[0], dots[2])
    back = layer.rope(layer.rope(a, torch.tensor(9)), torch.tensor(9), inverse=True)
    torch.testing.assert_close(back, a)


# --------------------------------------------------------------------------- layer


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_shapes(ratio: int) -> None:
    layer = make_layer(ratio)
    seq = SEQ[ratio]
    x = torch.randn(2, seq, HIDDEN)
    pos = torch.arange(seq).expand(2, seq)
    assert layer(x).shape == (2, seq, HIDDEN)
    q, kv, qr = layer.project(x, pos)
    assert q.shape == (2, seq, 4, 32) and kv.shape == (2, seq, 32) and qr.shape == (2, seq, 32)
    assert layer.attend(q, kv, window_indices(seq, 8).expand(2, -1, -1)).shape == q.shape
    if ratio == 0:
        assert layer.compressor is None and layer.indexer is None
        return
    assert layer.compressor(x).shape == (2, seq // ratio, 32)
    assert layer.compressor(x[:, : ratio - 1]).shape == (2, 0, 32)
    if ratio == 4:
        ind = layer.indexer
        keys = ind.compressor(x)
        q_idx, w = ind.queries(qr, pos), ind.weights(x)
        assert keys.shape == (2, seq // 4, 16)
        assert q_idx.shape == (2, seq, 2, 16) and w.shape == (2, seq, 2)
        scores = ind.scores(q_idx, w, keys)
        assert scores.shape == (2, seq, seq // 4) and scores.dtype == torch.float32
        visible = (torch.arange(seq) + 1) // 4
        assert layer.select_slots(scores, visible).shape == (2, seq, 4)
    else:
        assert layer.indexer is None


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_matches_per_token_loop(ratio: int) -> None:
    layer = make_layer(ratio)
    x = torch.randn(SEQ[ratio], HIDDEN)
    torch.testing.assert_close(layer(x[None])[0], naive_layer(layer, x))


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressor_segment_property(ratio: int, dtype: torch.dtype) -> None:
    layer = make_layer(ratio).to(dtype)
    x = torch.randn(2, 2 * 128 + 61, HIDDEN, dtype=dtype)
    compressors = [layer.compressor] + ([layer.indexer.compressor] if ratio == 4 else [])
    drop = 1 if ratio == 4 else 0  # the first slot of a segment lacks its predecessor
    for comp in compressors:
        full = comp(x)
        for a, b in [(ratio, x.shape[1]), (2 * ratio, 2 * ratio + 3 * ratio + 2), (0, 130)]:
            seg = comp(x[:, a:b], rope_pos_offset=a)
            first = a // ratio
            # Bitwise on CPU: the same per-row products and the same pooling order.
            assert torch.equal(seg[:, drop:], full[:, first + drop : first + (b - a) // ratio])


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_matches_slot_formula(ratio: int) -> None:
    """Slot j from docs/semantics.md section 3, one slot at a time."""
    layer = make_layer(ratio)
    comp, d = layer.compressor, 32
    x = torch.randn(2 * 128 + 5, HIDDEN)
    kv, score = x @ comp.wkv.weight.T, x @ comp.wgate.weight.T
    score = score + comp.ape[torch.arange(x.shape[0]) % ratio]  # ape row = offset in block
    slots = comp(x[None])[0]
    for j in range(x.shape[0] // ratio):
        own = range(ratio * j, ratio * (j + 1))
        if ratio == 4:  # previous block through the first d channels, own through the last d
            prev = list(range(max(0, 4 * j - 4), 4 * j))
            rows_kv = torch.cat((kv[prev, :d], kv[own, d:]))
            rows_score = torch.cat((score[prev, :d], score[own, d:]))
        else:
            rows_kv, rows_score = kv[own], score[own]
        pooled = (rows_kv * rows_score.softmax(dim=0)).sum(0)
        ref = layer.rope(comp.norm(pooled), torch.tensor(ratio * j))
        torch.testing.assert_close(slots[j], ref)


def test_overlap_slot_dependency() -> None:
    layer = make_layer(4)
    x = torch.randn(1, 24, HIDDEN, requires_grad=True)
    slots = layer.compressor(x)
    for j in (0, 1, 3, 5):
        (grad,) = torch.autograd.grad(slots[0, j].sum(), x, retain_graph=True)
        rows = grad[0].abs().sum(-1).nonzero().flatten().tolist()
        assert rows == list(range(max(0, 4 * j - 4), 4 * j + 4))


def test_hca_slot_dependency() -> None:
    layer = make_layer(128)
    x = torch.randn(1, 300, HIDDEN, requires_grad=True)
    slots = layer.compressor(x)
    (grad,) = torch.autograd.grad(slots[0, 1].sum(), x)
    assert grad[0].abs().sum(-1).nonzero().flatten().tolist() == list(range(128, 256))


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_causality(ratio: int) -> None:
    layer = make_layer(ratio)
    seq = SEQ[ratio]
    x = torch.randn(1, seq, HIDDEN, requires_grad=True)
    out = layer(x)
    for t in (0, 3, seq // 2, seq - 2):
        (grad,) = torch.autograd.grad(out[0, t].sum(), x, retain_graph=True)
        assert grad[0, t].abs().sum() > 0
        assert torch.equal(grad[0, t + 1 :], torch.zeros_like(grad[0, t + 1 :]))


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_packed_equals_separate_documents(ratio: int) -> None:
    layer = make_layer(ratio)
    lengths = [5, 130, 41] if ratio == 128 else [5, 18, 1, 13]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(int(cu[-1]), HIDDEN)
    packed = layer(x, cu_seqlens=cu)
    assert packed.shape == x.shape
    assert layer(x[None], cu_seqlens=cu).shape == (1, *x.shape)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        torch.testing.assert_close(packed[start:end], layer(x[None, start:end])[0])
    # Explicit doc-relative position_ids give the same result as the default.
    pos = torch.cat([torch.arange(n) for n in lengths])
    torch.testing.assert_close(layer(x, position_ids=pos, cu_seqlens=cu), packed)


def test_packed_window_clipped_at_document_start() -> None:
    layer = make_layer(4)  # window 8
    cu = torch.tensor([0, 10, 30])
    x = torch.randn(30, HIDDEN, requires_grad=True)
    out = layer(x, cu_seqlens=cu)
    for t in (10, 12, 17, 29):  # rows of document 2, including within W of its start
        (grad,) = torch.autograd.grad(out[t].sum(), x, retain_graph=True)
        assert torch.equal(grad[:10], torch.zeros_like(grad[:10]))
        assert grad[max(10, t - 7)].abs().sum() > 0  # the oldest key in the window is used


def test_rejects_bad_cu_seqlens() -> None:
    layer = make_layer(0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(10, HIDDEN), cu_seqlens=torch.tensor([0, 4, 9]))


def test_swa_output_invariant_to_position_shift() -> None:
    """RoPE on q and k plus inverse RoPE on o at the query position make r = 0 relative."""
    layer = make_layer(0)
    x = torch.randn(1, 20, HIDDEN)
    pos = torch.arange(20)
    torch.testing.assert_close(layer(x, position_ids=pos + 1000), layer(x, position_ids=pos))


def test_position_ids_shapes_agree() -> None:
    layer = make_layer(4)
    x = torch.randn(2, 17, HIDDEN)
    pos = torch.arange(17) + 3
    torch.testing.assert_close(layer(x, position_ids=pos), layer(x, position_ids=pos.expand(2, 17)))


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_fp32_backward_grads_finite(ratio: int) -> None:
    layer = make_layer(ratio)
    x = torch.randn(2, SEQ[ratio], HIDDEN, requires_grad=True)
    layer(x).square().mean().backward()
    assert x.grad is not None and x.grad.isfinite().all()
    for name, param in layer.named_parameters():
        # every parameter, the indexer's too: it learns from its KL loss in training mode
        assert param.grad is not None and param.grad.isfinite().all(), name
    assert layer.attn_sink.grad.abs().sum() > 0


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_bf16_runs(ratio: int) -> None:
    layer = make_layer(ratio)
    x = torch.randn(2, SEQ[ratio], HIDDEN)
    ref = layer(x)
    layer = layer.to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_()
    out = layer(xb)
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
    out.float().square().mean().backward()
    assert xb.grad is not None and xb.grad.isfinite().all()
    if ratio != 4:  # r = 4 may pick other slots under bf16 rounding
        torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)
