"""An optional sink, and rows that see nothing, in every shipped kernel; the indexer loss's
teacher for latent (MLA) attention.

* Kernels on one process (small-op, efficient, Triton under its interpreter, banded on a
  real plan without a window): ``sink=None``, a sink of ``-inf`` and a finite one against
  the softmax written out in the test; rows whose every column is ``-1`` give 0 and zero,
  finite gradients; ``sink=None`` gets no gradient and equals a sink of ``-inf``.
* CP (2 gloo ranks, ``sink_cases.py``): the reference layer without a window (the first
  rows of each document, and hp_cp's layout padding rows, see nothing) for {sink None,
  -inf, finite} x {padded, packed} x {contiguous, load-balanced} x {banded, smallop,
  efficient, triton, model_ops}: no NaN on any rank (padding rows included), output and
  input gradient within 1e-5 / 1e-4 of one process, every parameter gradient within 1e-4,
  the indexer loss within 1e-4 (relative).
* The indexer loss: no sink and rows that see nothing give a finite KL, 0 on those rows;
  ``kind="latent"``'s teacher (the absorbed form) equals the one computed from every
  token's expanded keys.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from cases import rel_err, result
from sink_cases import SINKS, one_process, sink_cases
from test_banded import plan_case
from test_efficient import assert_close

from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_torch.attention import run_sparse_attention
from hp_cp_torch.kernels.efficient import sparse_attention_efficient
from hp_cp_torch.kernels.smallop import sparse_attention_smallop
from hp_cp_torch.model.indexer_loss import indexer_kl_rows, indexer_loss_share
from hp_cp_torch.model.spec import Latent

SUITE = "sink_cases:sink_suite"


def _sink(kind: str, heads: int, gen: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "-inf":
        return torch.full((heads,), float("-inf"))
    return torch.randn(heads, generator=gen)


def _written_out(q, pool, idx, sink, scale) -> torch.Tensor:
    """The softmax with the sink, written out per (row, head) in float64; 0 where a row has
    no column and no sink."""
    batch, seq, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for s in range(seq):
            cols = [int(c) for c in idx[b, s] if c >= 0]
            for h in range(heads):
                logits = [scale * float(q[b, s, h].double() @ pool[b, c].double()) for c in cols]
                sink_logit = -math.inf if sink is None else float(sink[h])
                m = max([*logits, sink_logit])
                if m == -math.inf:
                    continue
                w = [math.exp(x - m) for x in logits]
                denom = sum(w) + math.exp(sink_logit - m)
                for wi, c in zip(w, cols):
                    out[b, s, h] += wi / denom * pool[b, c].double()
    return out


def _column_kernels() -> dict[str, object]:
    kernels = {"smallop": sparse_attention_smallop, "efficient": sparse_attention_efficient}
    try:
        from hp_cp_torch.kernels.triton_attention import sparse_attention_triton, triton_problem
    except ImportError:  # pragma: no cover - triton is a test dependency
        return kernels
    if triton_problem("cpu") is None:
        kernels["triton"] = sparse_attention_triton
        kernels["triton-head_blocks"] = lambda *a: sparse_attention_triton(
            *a, tuning={"fwd": {"LAYOUT": "head_blocks"}}
        )
    return kernels


COLUMN_KERNELS = _column_kernels()


def _grads(fn, q, pool, idx, sink, scale):
    leaves = [t.clone().requires_grad_(True) for t in (q, pool)]
    sink_leaf = None if sink is None else sink.clone().requires_grad_(True)
    out = fn(*leaves, idx, sink_leaf, scale)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    wanted = leaves + ([] if sink_leaf is None else [sink_leaf])
    return out, torch.autograd.grad((out * cot).sum(), wanted)


@pytest.mark.parametrize("kernel", sorted(COLUMN_KERNELS))
@pytest.mark.parametrize("sink_kind", SINKS)
def test_column_kernels_optional_sink_and_empty_rows(kernel: str, sink_kind: str) -> None:
    """Against the softmax written out; empty rows give 0 with zero gradients, no NaN."""
    gen = torch.Generator().manual_seed(0)
    batch, seq, heads, dim, n_pool, k = 2, 6, 3, 8, 7, 5
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    pool = torch.randn(batch, n_pool, dim, generator=gen)
    idx = torch.randint(0, n_pool, (batch, seq, k), generator=gen)
    idx[:, 1] = -1  # rows that see nothing
    idx[0, 4, :3] = -1
    sink = _sink(sink_kind, heads, gen)
    fn = COLUMN_KERNELS[kernel]
    out, grads = _grads(fn, q, pool, idx, sink, 0.3)
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    assert_close(out, _written_out(q, pool, idx, sink, 0.3), 1e-5)
    assert not out[:, 1].any() and not grads[0][:, 1].any()  # 0 out, no dq
    ref_out, ref_grads = _grads(sparse_attention_smallop, q, pool, idx, sink, 0.3)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, 1e-4)
    if sink is None:  # equals a sink of -inf, whose gradient is 0
        neg = torch.full((heads,), float("-inf"))
        out_neg, grads_neg = _grads(fn, q, pool, idx, neg, 0.3)
        assert torch.equal(out, out_neg)
        assert not grads_neg[2].any()


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("sink_kind", SINKS)
def test_banded_without_window_optional_sink(layout: str, sink_kind: str) -> None:
    """The banded kernel on a real plan without a window (a document's first rows see no
    slot) equals the small-op kernel, forward and backward, with no NaN."""
    cu = [0, 2, 2, 40, 45, 92]
    plan, q, ori_ext, cmp_kv, selected, _ = plan_case(4, layout, seq=92, window=0, cu=cu)
    sink = _sink(sink_kind, q.shape[2], torch.Generator().manual_seed(1))
    got = _run(plan, q, ori_ext, cmp_kv, selected, sink, "banded")
    want = _run(plan, q, ori_ext, cmp_kv, selected, sink, "smallop")
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert_close(a, b, 1e-4)


def _run(plan, q, ori_ext, cmp_kv, selected, sink, kernel):
    leaves = [t.clone().requires_grad_(True) for t in (q, ori_ext, cmp_kv)]
    sink_leaf = None if sink is None else sink.clone().requires_grad_(True)
    out = run_sparse_attention(
        *leaves[:2], leaves[2], plan, selected, sink_leaf, 0.25, kernel=kernel, query_chunk=16
    )
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    wanted = leaves + ([] if sink_leaf is None else [sink_leaf])
    return (out, *torch.autograd.grad((out * cot).sum(), wanted))


# ------------------------------------------------------------------------------ CP matrix

CASES = [pytest.param(sc, id=sc.name) for sc in sink_cases()]


@pytest.mark.parametrize("sc", CASES)
def test_cp_matrix_matches_one_process_without_nan(sc) -> None:
    per_rank = result(SUITE, 2, sc.name)
    assert all(r["padded"] for r in per_rank), "the case must have layout padding rows"
    assert all(r["finite"] for r in per_rank), "NaN / inf in a rank's output or gradients"
    got = next(r for r in per_rank if "out" in r)
    want = one_process(sc)
    assert torch.isfinite(want["out"]).all()
    assert not want["out"][..., :3, :].any()  # a document's first r - 1 rows see nothing
    assert rel_err(got["out"], want["out"]) <= 1e-5
    assert rel_err(got["gx"], want["gx"]) <= 1e-4
    assert got["pgrads"].keys() == want["pgrads"].keys()
    assert ("attn_sink" in want["pgrads"]) == (sc.sink != "none")
    for name, ref in want["pgrads"].items():
        if ref is None:
            assert not got["pgrads"][name].any(), name
            continue
        assert rel_err(got["pgrads"][name], ref) <= 1e-4, name
    if sc.sink == "-inf":
        assert not got["pgrads"]["attn_sink"].any()
    loss, ref_loss = float(got["indexer_loss"]), float(want["indexer_loss"])
    # a small loss (few rows, 3.6e-4) of cancelling fp32 terms: 1e-4 relative
    assert math.isfinite(loss) and abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)


# ------------------------------------------------------------------------------ indexer loss


def test_indexer_kl_without_sink_and_rows_that_see_nothing() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 2, 8, generator=gen)
    pool = torch.randn(1, 6, 8, generator=gen)
    window = torch.full((1, 4, 2), -1)
    slots = torch.tensor([[[-1, -1], [3, -1], [-1, -1], [4, 5]]])
    student = torch.randn(1, 4, 2, generator=gen, requires_grad=True)
    for sink in (None, torch.full((2,), float("-inf"))):
        kl = indexer_kl_rows(q, pool, window, slots, student, sink, 0.3)
        (grad,) = torch.autograd.grad(kl.sum(), student)
        assert torch.isfinite(kl).all() and torch.isfinite(grad).all()
        assert kl[0, 0] == 0 and kl[0, 2] == 0 and kl[0, 3] > 0


def test_latent_indexer_loss_teacher_is_the_expanded_attention() -> None:
    """``kind="latent"``: the teacher in the absorbed form equals the main attention's weights
    computed from every token's expanded keys ``[W_k c_j ; k_rot_j]`` over the picks."""
    gen = torch.Generator().manual_seed(4)
    batch, seq, heads, nope, rope, value, rank, k = 2, 10, 3, 6, 4, 5, 7, 4
    spec = LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)
    plan = build_rank_plan(
        rank=0, cp_size=1, spec=spec, layout_kind="contiguous", total_rows=seq, cu_seqlens=None
    )
    q = torch.randn(batch, seq, heads, nope + rope, generator=gen)
    latents = torch.randn(batch, seq, rank + rope, generator=gen)
    up_proj = torch.randn(heads * (nope + value), rank, generator=gen)
    keys = torch.rand(batch, seq, seq, generator=gen).tril()  # token t picks among 0 .. t
    selected = keys.masked_fill(keys == 0, -1.0).topk(k, dim=-1).indices
    visible = torch.arange(seq)[:, None] >= torch.arange(k)[None, :]  # t sees t + 1 tokens
    selected = torch.where(visible, selected, -1)
    student = torch.randn(batch, seq, k, generator=gen, requires_grad=True)
    call = SimpleNamespace(plan=plan, config=SimpleNamespace(query_chunk=3), loss_rows=batch * seq)
    latent = Latent(nope, rope, value, rank, up_proj)
    ori_ext = latents[:, :0]
    got = indexer_loss_share(call, q, ori_ext, latents, selected, student, None, 0.3, latent=latent)
    # the dense expanded form: every token's keys per head, the logits over all tokens
    w_k = up_proj.view(heads, nope + value, rank)[:, :nope]  # [H, nope, rank]
    k_nope = torch.einsum("hdr,bnr->bnhd", w_k, latents[..., :rank])
    k_rot = latents[..., None, rank:].expand(-1, -1, heads, -1)
    expanded = torch.cat([k_nope, k_rot], dim=-1).double()  # [B, N, H, nope + rope]
    logits = torch.einsum("bthd,bnhd->bthn", q.double(), expanded) * 0.3
    ok = selected >= 0
    at = logits.gather(-1, selected.clamp(min=0)[:, :, None, :].expand(-1, -1, heads, -1))
    at = at.masked_fill(~ok[:, :, None, :], -math.inf)
    mass = torch.softmax(at, dim=-1).sum(dim=2)  # [B, T, k]
    target = mass / mass.sum(-1, keepdim=True)
    log_student = torch.log_softmax(student.double().masked_fill(~ok, -math.inf), dim=-1)
    kl = torch.where(ok, target * (torch.log(target) - log_student), 0.0).sum(-1)
    want = kl.sum() / (batch * seq)
    assert torch.isfinite(got)
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    (grad,) = torch.autograd.grad(got, student)
    (ref_grad,) = torch.autograd.grad(want, student)
    assert_close(grad, ref_grad, 1e-4)
