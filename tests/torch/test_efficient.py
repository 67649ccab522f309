"""The memory-efficient sparse attention kernel against the small-op reference kernel."""

from __future__ import annotations

import pytest
import torch

import hp_cp_torch.kernels.efficient as efficient
from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_torch.attention import run_sparse_attention
from hp_cp_torch.kernels.efficient import sparse_attention_efficient
from hp_cp_torch.kernels.smallop import sparse_attention_smallop


def random_case(batch=2, seq=19, heads=3, dim=16, pool=23, k=11, dtype=torch.float32, seed=0):
    """Random inputs with -1 columns, an all -1 row per batch and duplicate columns."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g).to(dtype)
    kv = torch.randn(batch, pool, dim, generator=g).to(dtype)
    idx = torch.randint(0, max(pool, 1), (batch, seq, k), generator=g)
    idx = torch.where(torch.rand(batch, seq, k, generator=g) < 0.3, -1, idx)
    if seq > 2 and k > 2:
        idx[:, 2] = -1  # empty rows
        idx[:, 1, 1] = idx[:, 1, 0] = 5 % max(pool, 1)  # duplicates
    if pool == 0:
        idx = torch.full_like(idx, -1)
    sink = torch.randn(heads, generator=g)
    return q, kv, idx, sink


def run(fn, q, kv, idx, sink, scale, grad_seed=1):
    q = q.detach().clone().requires_grad_(True)
    kv = kv.detach().clone().requires_grad_(True)
    sink = sink.detach().clone().requires_grad_(True)
    out = fn(q, kv, idx, sink, scale)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    leaves = [q, kv, sink]
    grads = torch.autograd.grad((out.float() * g.float()).sum(), leaves, allow_unused=True)
    # an empty pool is disconnected in the small-op path: its gradient is all zeros
    grads = [torch.zeros_like(t) if d is None else d for d, t in zip(grads, leaves)]
    return (out, *grads)


def assert_close(a, b, tol):
    scale = max(b.abs().max().item(), 1e-30)
    assert (a.float() - b.float()).abs().max().item() <= tol * scale, (a, b)


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(batch=1, seq=40, k=7),
        dict(k=0),
        dict(pool=0, k=4),
        dict(seq=0),
        dict(batch=3, seq=5, heads=1, dim=8, pool=2, k=9),
    ],
)
@pytest.mark.parametrize("chunk", [1, 4, 256])
def test_matches_smallop_fp32(shape, chunk, monkeypatch):
    monkeypatch.setattr(efficient, "MAX_CHUNK_ROWS", chunk)
    q, kv, idx, sink = random_case(**shape)
    ref = run(sparse_attention_smallop, q, kv, idx, sink, 0.3)
    got = run(sparse_attention_efficient, q, kv, idx, sink, 0.3)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.isfinite(a).all()
        if b.numel():
            assert_close(a, b, 1e-5)


def test_empty_rows_give_zero_output_and_finite_grads():
    q, kv, idx, sink = random_case()
    out, dq, dkv, dsink = run(sparse_attention_efficient, q, kv, idx, sink, 0.25)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
    assert torch.equal(dq[:, 2], torch.zeros_like(dq[:, 2]))
    assert all(torch.isfinite(t).all() for t in (dq, dkv, dsink))


def test_int32_index_and_no_grad_inputs():
    q, kv, idx, sink = random_case()
    ref = sparse_attention_smallop(q, kv, idx, sink, 0.5)
    got = sparse_attention_efficient(q, kv, idx.int(), sink, 0.5)
    assert_close(got, ref, 1e-6)
    qg = q.clone().requires_grad_(True)  # only q needs a gradient
    (dq,) = torch.autograd.grad(sparse_attention_efficient(qg, kv, idx, sink, 0.5).sum(), [qg])
    (dq_ref,) = torch.autograd.grad(sparse_attention_smallop(qg, kv, idx, sink, 0.5).sum(), [qg])
    assert_close(dq, dq_ref, 1e-5)


def test_bf16_runs_and_tracks_fp32():
    q, kv, idx, sink = random_case(seq=33, dim=32, pool=40, k=13, dtype=torch.bfloat16)
    got = run(sparse_attention_efficient, q, kv, idx, sink, 0.2)
    ref32 = run(sparse_attention_smallop, q.float(), kv.float(), idx, sink, 0.2)
    ref16 = run(sparse_attention_smallop, q, kv, idx, sink, 0.2)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.bfloat16
    assert got[3].dtype == torch.float32
    for a, b, c in zip(got, ref32, ref16):
        assert torch.isfinite(a).all()
        # no worse than the small-op path in bf16 (which rounds its per-column KV gradient)
        err = (a.float() - b).abs().max().item()
        assert err <= max(2 * (c.float() - b).abs().max().item(), 2e-2 * b.abs().max().item())


def saved_bytes(fn, k: int, *, seq=64, heads=4, dim=32, pool=300) -> dict[str, int]:
    """Bytes of the unique storages autograd keeps for backward, split index / other."""
    q, kv, idx, sink = random_case(batch=1, seq=seq, heads=heads, dim=dim, pool=pool, k=k)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    sink.requires_grad_(True)
    seen: dict[tuple, tuple[int, bool]] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[(st.data_ptr(), st.nbytes())] = (st.nbytes(), not t.is_floating_point())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(q, kv, idx, sink, 0.1)
    out.sum().backward()  # the saved tensors are usable
    index = sum(n for n, is_index in seen.values() if is_index)
    other = sum(n for n, is_index in seen.values() if not is_index)
    return {"index": index, "other": other}


def test_saved_bytes_do_not_grow_with_k():
    small, large = 16, 160
    eff_s, eff_l = (
        saved_bytes(sparse_attention_efficient, small),
        saved_bytes(sparse_attention_efficient, large),
    )
    ref_s, ref_l = (
        saved_bytes(sparse_attention_smallop, small),
        saved_bytes(sparse_attention_smallop, large),
    )
    # efficient: only the index list (int32, 4 bytes a column) grows with K
    assert eff_s["other"] == eff_l["other"]
    assert eff_l["index"] - eff_s["index"] == 64 * (large - small) * 4
    # small-op: the gathered fp32 rows alone add 4 * D bytes a column
    assert ref_l["other"] - ref_s["other"] >= 64 * (large - small) * 32 * 4
    assert eff_l["index"] + eff_l["other"] < 0.1 * (ref_l["index"] + ref_l["other"])


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_run_sparse_attention_kernels_agree(ratio):
    """The ``attention_kernel="efficient"`` route through ``run_sparse_attention``."""
    seq, heads, dim, topk = 600, 2, 16, 5
    spec = LayerSpec(compress_ratio=ratio, window_size=16, has_indexer=ratio == 4)
    plan = build_rank_plan(
        rank=1, cp_size=2, spec=spec, layout_kind="load_balanced", total_rows=seq
    )
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, plan.n_local, heads, dim, generator=g)
    ori_ext = torch.randn(1, plan.window.ext_rows.size, dim, generator=g)
    cmp_kv = torch.randn(1, plan.n_needed_slots, dim, generator=g) if ratio else None
    selected = None
    if ratio == 4:
        count = torch.as_tensor(plan.cmp_count)
        start = torch.as_tensor(plan.cmp_start)
        pick = torch.randint(0, 1 << 30, (1, plan.n_local, topk), generator=g)
        pick = start[:, None] + pick % count.clamp(min=1)[:, None]
        selected = torch.where(torch.arange(topk) < count[:, None], pick, -1)
    sink = torch.randn(heads, generator=g)
    leaves = [t.requires_grad_(True) for t in (q, ori_ext, sink, cmp_kv) if t is not None]
    results = []
    for kernel in ("smallop", "efficient"):
        out = run_sparse_attention(
            q, ori_ext, cmp_kv, plan, selected, sink, 0.25, kernel=kernel, query_chunk=64
        )
        results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
    for a, b in zip(*results):
        assert_close(a, b, 1e-5)
