"""The banded kernel (window and HCA slots as dense bands, top-k gathered) against the small-op
reference kernel, through ``run_sparse_attention`` on real plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_efficient import assert_close

import hp_cp_torch.kernels.banded as banded
from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_torch.attention import run_sparse_attention


def plan_case(
    ratio,
    layout,
    *,
    rank=1,
    cp=2,
    seq=600,
    window=16,
    cu=None,
    batch=2,
    seed=3,
    distinct=False,
    heads=2,
    dim=16,
):
    """A rank's plan and random inputs: queries, window KV, slots, picks (-1 included;
    duplicates too unless ``distinct``, as the indexer's top-k gives), sink."""
    spec = LayerSpec(compress_ratio=ratio, window_size=window, has_indexer=ratio == 4)
    plan = build_rank_plan(
        rank=rank, cp_size=cp, spec=spec, layout_kind=layout, total_rows=seq, cu_seqlens=cu
    )
    g = torch.Generator().manual_seed(seed)
    topk = 5
    q = torch.randn(batch, plan.n_local, heads, dim, generator=g)
    ori_ext = torch.randn(batch, plan.window.ext_rows.size, dim, generator=g)
    cmp_kv = torch.randn(batch, plan.n_needed_slots, dim, generator=g) if ratio else None
    selected = None
    if ratio == 4:
        count = torch.as_tensor(plan.cmp_count)
        start = torch.as_tensor(plan.cmp_start)
        pick = torch.randint(0, 1 << 30, (batch, plan.n_local, topk), generator=g)
        pick = start[:, None] + pick % count.clamp(min=1)[:, None]  # duplicates happen
        if distinct:  # a random top-k of the visible slots
            slots = torch.arange(plan.n_needed_slots)
            seen = (slots >= start[:, None]) & (slots < (start + count)[:, None])
            keys = torch.rand(batch, plan.n_local, plan.n_needed_slots, generator=g)
            pick = keys.masked_fill(~seen, -1.0).topk(topk, dim=-1).indices
        selected = torch.where(torch.arange(topk) < count[:, None], pick, -1)
    sink = torch.randn(heads, generator=g)
    return plan, q, ori_ext, cmp_kv, selected, sink


def outputs_and_grads(kernel, plan, q, ori_ext, cmp_kv, selected, sink, picks="weights"):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, ori_ext, sink)]
    if cmp_kv is not None:
        leaves.append(cmp_kv.detach().clone().requires_grad_(True))
    q, ori_ext, sink = leaves[:3]
    cmp = leaves[3] if cmp_kv is not None else None
    out = run_sparse_attention(
        q,
        ori_ext,
        cmp,
        plan,
        selected,
        sink,
        0.25,
        kernel=kernel,
        query_chunk=64,
        banded_picks=picks,
    )
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return (out, *torch.autograd.grad((out * grad).sum(), leaves))


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize(
    "layout,packed", [("contiguous", False), ("load_balanced", False), ("load_balanced", True)]
)
@pytest.mark.parametrize("block", [7, 64])
def test_banded_matches_smallop(ratio, layout, packed, block, monkeypatch):
    monkeypatch.setattr(banded, "BLOCK_ROWS", block)
    seq = 600
    cu = np.array([0, 37, 38, seq // 2, seq - 45, seq]) if packed else None
    case = plan_case(ratio, layout, seq=seq, cu=cu)
    ref = outputs_and_grads("smallop", *case)
    got = outputs_and_grads("banded", *case)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.isfinite(a).all()
        assert_close(a, b, 1e-5)


@pytest.mark.parametrize("kernel", ["banded", "efficient"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_kernels_at_v4_flash_head_dim(kernel, ratio):
    """V4-Flash's head_dim 512 (and 16 heads, over a hundred and twenty-eight lanes of any
    tile), bf16 inputs as the model gives them: the kernels against the small-op kernel on
    the same bf16 inputs, outputs and every gradient."""
    case = plan_case(ratio, "load_balanced", seq=264, window=16, batch=1, heads=16, dim=512)
    half = [t.bfloat16() if t is not None and t.is_floating_point() else t for t in case[1:]]
    ref = outputs_and_grads("smallop", case[0], *half)
    got = outputs_and_grads(kernel, case[0], *half)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.isfinite(a.float()).all()
        assert_close(a, b, 1e-2)  # bf16 outputs: one rounding of each side's fp32 sum


@pytest.mark.parametrize("picks", banded.PICK_READS)
@pytest.mark.parametrize("layout,packed", [("contiguous", False), ("load_balanced", True)])
@pytest.mark.parametrize("factor", [2, 1000])
def test_banded_picks_read_as_a_band(picks, layout, packed, factor, monkeypatch):
    """Distinct picks (the indexer's) in a narrow band are read as a slot band (weighted by
    pick count, or masked), not gathered; the result is the small-op kernel's. A pick list with
    a repeated pick: the weights read it as a band too, the repeat adding up as in the gather;
    the mask (it cannot count a column twice) gathers that block."""
    monkeypatch.setattr(banded, "PICKS_BAND_FACTOR", factor)
    reads = []  # (band start, band stop, read as a band)
    original = banded._read_picks

    def spy(how, sel, blk, ws):
        weights = original(how, sel, blk, ws)
        assert how == picks
        reads.append((blk.slot_start, blk.slot_stop, weights is not None))
        return weights

    monkeypatch.setattr(banded, "_read_picks", spy)
    seq = 600
    cu = np.array([0, 37, 38, seq // 2, seq - 45, seq]) if packed else None
    case = plan_case(4, layout, seq=seq, cu=cu, distinct=True)
    ref = outputs_and_grads("smallop", *case)
    got = outputs_and_grads("banded", *case, picks=picks)
    for a, b in zip(got, ref):
        assert_close(a, b, 1e-5)
    if factor > 2:  # every block's band is narrow enough
        assert reads and all(band for _, _, band in reads)

    # a foreign pick list with a repeated pick
    plan, q, ori, cmp, sel, sink = case
    sel = sel.clone()
    row = int(np.flatnonzero(plan.cmp_count >= 2)[-1])
    sel[0, row, 1] = sel[0, row, 0]
    reads.clear()
    ref = outputs_and_grads("smallop", plan, q, ori, cmp, sel, sink)
    got = outputs_and_grads("banded", plan, q, ori, cmp, sel, sink, picks=picks)
    for a, b in zip(got, ref):
        assert_close(a, b, 1e-5)
    if factor > 2:
        banded_reads = [band for _, _, band in reads]
        if picks == "mask":  # the block with the repeat is gathered, forward and backward
            assert banded_reads.count(False) == 2 and any(banded_reads)
        else:
            assert reads and all(banded_reads)


def test_picks_bias_counts_each_pick():
    sel = torch.tensor([[[3, 5, -1], [4, 4, 6]]])
    bias = banded._picks_bias(sel, 3, 7)
    assert bias.exp().tolist() == [[[1.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 1.0]]]  # the counts
    # the table lookup gives what a log of the counts gives, bit for bit
    assert torch.equal(bias, banded._picks_log_bias(sel, 3, 7))
    assert banded._picks_mask(sel, 3, 7) is None  # a mask cannot count the repeated 4
    assert banded._picks_mask(sel[:, :1], 3, 7).tolist() == [[[True, False, True, False]]]


def test_picks_bias_table_equals_log_on_a_real_block():
    """The shipped lookup and the log of the counts agree bitwise on a bench-sized block, with
    repeats up to the top-k (every pick the same slot)."""
    g = torch.Generator().manual_seed(0)
    sel = torch.rand(2, 32, 768, generator=g).topk(512, dim=-1).indices + 100
    sel[0, 0] = 300  # one slot picked 512 times
    sel[1, 3, :7] = -1
    ws = banded._Workspace()
    table = ws.log_counts(512, sel)
    assert ws.log_counts(512, sel) is table  # built once per call
    got = banded._picks_bias(sel, 100, 868, table)
    assert torch.equal(got, banded._picks_log_bias(sel, 100, 868))
    assert got[0, 0, 200].item() == pytest.approx(np.log(512))


def test_banded_rejects_an_unknown_picks_read():
    case = plan_case(4, "contiguous", seq=200)
    with pytest.raises(ValueError, match="picks='gather' is not a way to read picks"):
        outputs_and_grads("banded", *case, picks="gather")


def test_banded_rank_without_slots_and_bf16():
    """Rank 0 of a contiguous layout at r = 128 sees no slot; bf16 inputs stay bf16 and track
    the fp32 reference as closely as the small-op kernel in bf16."""
    case = plan_case(128, "contiguous", rank=0, seq=200)
    assert case[0].n_needed_slots == 0
    for a, b in zip(outputs_and_grads("banded", *case), outputs_and_grads("smallop", *case)):
        assert a.shape == b.shape
        if b.numel():
            assert_close(a, b, 1e-5)
    case = plan_case(4, "load_balanced", seq=600)
    half = [t.bfloat16() if t is not None and t.is_floating_point() else t for t in case[1:]]
    got = outputs_and_grads("banded", case[0], *half)
    ref32 = outputs_and_grads("smallop", *case)
    ref16 = outputs_and_grads("smallop", case[0], *half)
    assert got[0].dtype == torch.bfloat16
    for a, b, c in zip(got, ref32, ref16):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= max(2 * (c.float() - b.float()).abs().max().item(), 2e-2 * b.abs().max())
