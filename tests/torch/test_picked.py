"""hp_cp_torch.kernels.picked against a dense reference computed in the test: every key and
value expanded per head, each query's row over all rows with the unpicked masked; grouped
heads with values apart from keys (MQA to MHA), the latent (MLA) fold, an optional sink, rows
that see nothing, each strategy pinned and chosen, real plans (both layouts, packed), outputs
and every input's gradient; autograd's numerical check in float64."""

from __future__ import annotations

import pytest
import torch

from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_torch.kernels.picked import HeadLayout, picked_attention

SCALE = 0.3


def plan_and_picks(layout: str, seq: int, topk: int, *, rank=1, cp=2, cu=None, batch=2, seed=0):
    """A DSA plan (ratio 1, no window) and a random top-k of each query's visible rows (``-1``
    where it sees fewer; a query that sees nothing has none)."""
    spec = LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)
    plan = build_rank_plan(
        rank=rank, cp_size=cp, spec=spec, layout_kind=layout, total_rows=seq, cu_seqlens=cu
    )
    g = torch.Generator().manual_seed(seed)
    n = plan.n_needed_slots
    start, count = torch.as_tensor(plan.cmp_start), torch.as_tensor(plan.cmp_count)
    slots = torch.arange(n)
    seen = (slots >= start[:, None]) & (slots < (start + count)[:, None])
    keys = torch.rand(batch, plan.n_local, n, generator=g).masked_fill(~seen, -1.0)
    k = min(topk, n)
    pick = keys.topk(k, dim=-1).indices
    selected = torch.where(torch.arange(k) < count[:, None], pick, -1)
    return plan, selected


def dense_reference(q, rows, selected, layout: HeadLayout, sink, up_proj):
    """Every head's keys and values expanded, the unpicked at ``-inf``, one softmax with the
    sink (``exp(sink - m)`` in the denominator), 0 where a row sees nothing."""
    b, length, heads, _ = q.shape
    n = rows.shape[1]
    g = layout.groups
    if layout.latent is not None:
        nope, rope, value, rank = layout.latent
        kv = torch.nn.functional.linear(rows[..., :rank], up_proj).view(b, n, heads, -1)
        k_nope, values = torch.split(kv, [nope, value], dim=-1)
        keys = torch.cat([k_nope, rows[:, :, None, rank:].expand(-1, -1, heads, -1)], -1)
    else:
        k_g, v_g = layout.split(layout.by_group(rows))  # [B, G, N, d]
        keys = k_g.transpose(1, 2).repeat_interleave(heads // g, dim=2)
        values = v_g.transpose(1, 2).repeat_interleave(heads // g, dim=2)
    keep = torch.zeros(b, length, n + 1)
    keep.scatter_add_(-1, torch.where(selected >= 0, selected, n), torch.ones(selected.shape))
    bias = keep[..., :n].log().to(q.dtype)  # [B, L, N]
    s = torch.einsum("blhd,bnhd->bhln", q, keys) * SCALE + bias[:, None]
    if sink is not None:
        s = torch.cat([s, sink.view(1, -1, 1, 1).expand(b, -1, length, 1)], -1)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isneginf(m), 0.0, m)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom > 0, denom, 1.0)
    if sink is not None:
        p = p[..., :-1]
    return torch.einsum("bhln,bnhd->blhd", p, values)


def case(kind: str, kv_heads: int, heads: int, dtype=torch.float32, seed=0):
    """``(layout, q width, rows width, up_proj or None)`` and a generator."""
    g = torch.Generator().manual_seed(seed)
    if kind == "latent":
        nope, rope, value, rank = 6, 4, 5, 7
        layout = HeadLayout.mla(nope, rope, value, rank)
        up = torch.randn(heads * (nope + value), rank, generator=g, dtype=dtype)
        return layout, nope + rope, up, g
    layout = HeadLayout.grouped(kv_heads, 6, 5)
    return layout, 6, None, g


def run_both(plan, selected, layout, qd, up, g, heads, sink_kind, strategy, dtype=torch.float32):
    b, length = selected.shape[:2]
    q = torch.randn(b, length, heads, qd, generator=g, dtype=dtype)
    rows = torch.randn(b, plan.n_needed_slots, layout.row_width, generator=g, dtype=dtype)
    sink = {
        None: None,
        "finite": torch.randn(heads, generator=g, dtype=dtype),
        "-inf": torch.full((heads,), float("-inf"), dtype=dtype),
    }[sink_kind]
    leaves = [t for t in (q, rows, sink, up) if t is not None and t.isfinite().all()]
    mine = [t.clone().requires_grad_() for t in leaves]
    ref = [t.clone().requires_grad_() for t in leaves]

    def bind(ts):
        it = iter(ts)
        given = (q, rows, sink, up)
        return [next(it) if t is not None and t.isfinite().all() else t for t in given]

    mq, mr, ms, mu = bind(mine)
    out = picked_attention(
        mq, mr, selected, plan, layout, SCALE, ms, mu, query_chunk=16, strategy=strategy
    )
    rq, rr, rs, ru = bind(ref)
    want = dense_reference(rq, rr, selected, layout, rs, ru)
    grad = torch.randn(out.shape, generator=g, dtype=dtype)
    got = torch.autograd.grad((out * grad).sum(), mine)
    wanted = torch.autograd.grad((want * grad).sum(), ref)
    return out, want, got, wanted


@pytest.mark.parametrize("strategy", ["auto", "dense", "gather"])
@pytest.mark.parametrize(
    ("kind", "kv_heads", "heads"),
    [("grouped", 1, 4), ("grouped", 2, 4), ("grouped", 4, 4), ("latent", 1, 3)],
)
@pytest.mark.parametrize("sink_kind", [None, "finite", "-inf"])
def test_matches_the_dense_reference(strategy, kind, kv_heads, heads, sink_kind) -> None:
    layout, qd, up, g = case(kind, kv_heads, heads)
    plan, selected = plan_and_picks("load_balanced", 160, 9, cu=[0, 61, 140, 157, 160])
    out, want, got, wanted = run_both(plan, selected, layout, qd, up, g, heads, sink_kind, strategy)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, wanted, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", ["dense", "gather"])
@pytest.mark.parametrize(("kind", "kv_heads", "heads"), [("grouped", 2, 4), ("latent", 1, 3)])
def test_bf16_is_no_further_from_float64_than_the_dense_op_order(strategy, kind, kv_heads, heads):
    """bf16 inputs: the kernel (fp32 logits and softmax, the weights rounded to bf16 for the
    products with values, keys and queries) is no further from float64 on the same rounded
    inputs than the dense reference run op by op in bf16, output and every gradient."""
    layout, qd, up, g = case(kind, kv_heads, heads)
    plan, selected = plan_and_picks("load_balanced", 160, 9, cu=[0, 61, 140, 157, 160])
    b, length = selected.shape[:2]
    q = torch.randn(b, length, heads, qd, generator=g)
    rows = torch.randn(b, plan.n_needed_slots, layout.row_width, generator=g)
    sink = torch.randn(heads, generator=g)
    grad = torch.randn(b, length, heads, layout.latent[2] if up is not None else 5, generator=g)
    given = [t.bfloat16() for t in (q, rows, sink, up) if t is not None]

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in given]
        q_, r_, s_, *u_ = leaves
        out = fn(q_, r_, s_, u_[0] if u_ else None)
        return [out, *torch.autograd.grad((out * grad.to(dtype)).sum(), leaves)]

    def kernel(q_, r_, s_, u_):
        return picked_attention(
            q_, r_, selected, plan, layout, SCALE, s_, u_, query_chunk=16, strategy=strategy
        )

    def dense(q_, r_, s_, u_):
        return dense_reference(q_, r_, selected, layout, s_, u_)

    exact = run(dense, torch.float64)
    mine, eager = run(kernel, torch.bfloat16), run(dense, torch.bfloat16)
    for m, e, x in zip(mine, eager, exact, strict=True):
        assert m.dtype == torch.bfloat16
        mine_err = (m.double() - x).norm() / x.norm()
        assert mine_err <= (e.double() - x).norm() / x.norm(), mine_err
        assert mine_err < 2e-2


@pytest.mark.parametrize("layout_kind", ["contiguous", "load_balanced"])
def test_rows_that_see_nothing_give_zero(layout_kind) -> None:
    """Rows with no pick (hp_cp's padding rows, an empty document) give 0 and finite
    gradients, with and without a sink of ``-inf``, in both strategies."""
    layout, qd, up, g = case("grouped", 2, 4)
    plan, selected = plan_and_picks(layout_kind, 92, 7, rank=1, cu=[0, 40, 70, 92])
    blind = torch.zeros(plan.n_local, dtype=torch.bool)
    blind[::5] = True
    selected[:, blind] = -1
    for sink_kind in (None, "-inf"):
        for strategy in ("dense", "gather"):
            out, want, got, wanted = run_both(
                plan, selected, layout, qd, up, g, 4, sink_kind, strategy
            )
            assert (out[:, blind] == 0).all()
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            for a, b in zip(got, wanted, strict=True):
                assert torch.isfinite(a).all()
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_strategies_are_really_both_taken() -> None:
    """With ``auto`` an early block reads a band and a late one gathers."""
    from hp_cp_core.columns import PlanColumns
    from hp_cp_torch.kernels.picked import band_factor

    plan, _ = plan_and_picks("contiguous", 400, 8, rank=1)
    blocks = PlanColumns(plan, 0).dense_blocks(16, picks_band_max=band_factor(4) * 8)
    plan0, _ = plan_and_picks("contiguous", 400, 8, rank=0)
    blocks0 = PlanColumns(plan0, 0).dense_blocks(16, picks_band_max=band_factor(4) * 8)
    assert any(b.picks_in_band for b in blocks0)
    assert not all(b.picks_in_band for b in blocks)


def test_gradcheck_float64() -> None:
    layout, qd, up, g = case("latent", 1, 2, dtype=torch.float64, seed=1)
    plan, selected = plan_and_picks("load_balanced", 40, 5, batch=1)
    q = torch.randn(1, plan.n_local, 2, qd, generator=g, dtype=torch.float64)
    rows = torch.randn(1, plan.n_needed_slots, layout.row_width, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, rows, up)]
    for strategy in ("dense", "gather"):

        def fn(q_, r_, u_, strategy=strategy):
            return picked_attention(
                q_, r_, selected, plan, layout, SCALE, None, u_, query_chunk=7, strategy=strategy
            )

        assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)
    sink = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()
    glayout = HeadLayout.grouped(2, 3, 2)
    q4 = torch.randn(1, plan.n_local, 4, 3, generator=g, dtype=torch.float64).requires_grad_()
    rows4 = torch.randn(1, plan.n_needed_slots, 10, generator=g, dtype=torch.float64)
    rows4.requires_grad_()

    def gfn(q_, r_, s_):
        return picked_attention(q_, r_, selected, plan, glayout, SCALE, s_, query_chunk=5)

    assert torch.autograd.gradcheck(gfn, [q4, rows4, sink], eps=1e-6, atol=1e-6)


def test_bad_layouts_are_refused() -> None:
    from hp_cp_core import HpCpError

    layout, qd, up, g = case("grouped", 2, 4)
    plan, selected = plan_and_picks("contiguous", 30, 4)
    q = torch.randn(2, plan.n_local, 3, qd)  # 3 heads over 2 KV heads
    rows = torch.randn(2, plan.n_needed_slots, layout.row_width)
    with pytest.raises(HpCpError, match="divisible"):
        picked_attention(q, rows, selected, plan, layout, SCALE)
    with pytest.raises(HpCpError, match="strategy"):
        picked_attention(q, rows, selected, plan, layout, SCALE, strategy="fast")


def test_the_bench_measures_both_strategies() -> None:
    """``python -m hp_cp_torch.bench.picked``'s measures run (tiny: the numbers are the bench's)."""
    from hp_cp_torch.bench.picked import block_seconds, grouped_ratio

    t = block_seconds(heads=2, k=4, n=8, repeat=1)
    assert set(t) == {"dense", "gather"} and all(v > 0 for v in t.values())
    assert grouped_ratio(2, seq=32, topk=4, repeat=1) > 0
