"""hp_cp_torch.kernels.latent_attention against transformers' dense MLA math: every token expanded
through ``kv_b_proj``, each query's row over all tokens with the unselected at ``finfo.min``;
outputs and every input's gradient, query chunks of any size, picks of ``-1``, and autograd's
numerical check in float64."""

from __future__ import annotations

import pytest
import torch

from hp_cp_torch.kernels.latent_attention import MLADims, latent_attention

DIMS = MLADims(nope=6, rope=4, value=5, rank=7, scaling=0.3)
B, H, L, N, K = 2, 3, 9, 13, 4


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q_pass = torch.randn(B, H, L, DIMS.nope, generator=g, dtype=dtype)
    q_rot = torch.randn(B, H, L, DIMS.rope, generator=g, dtype=dtype)
    latent = torch.randn(B, N, DIMS.rank + DIMS.rope, generator=g, dtype=dtype)
    weight = torch.randn(H * (DIMS.nope + DIMS.value), DIMS.rank, generator=g, dtype=dtype)
    selected = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B * L)]).view(B, L, K)
    selected[0, 0, 1:] = -1  # a query with one pick
    selected[1, 3, 2] = -1
    return q_pass, q_rot, latent, selected, weight


def _dense(q_pass, q_rot, latent, selected, weight) -> torch.Tensor:
    """transformers' ops: expand_kv of every token, the dense row, the unselected masked."""
    kv = torch.nn.functional.linear(latent[..., : DIMS.rank], weight)  # [B, N, H * (nope + v)]
    kv = kv.view(B, N, H, DIMS.nope + DIMS.value).transpose(1, 2)
    k_nope, values = torch.split(kv, [DIMS.nope, DIMS.value], dim=-1)
    k_rot = latent[:, None, :, DIMS.rank :].expand(-1, H, -1, -1)
    keys = torch.cat([k_nope, k_rot], dim=-1)
    query = torch.cat([q_pass, q_rot], dim=-1)
    keep = torch.zeros(B, L, N + 1, dtype=torch.bool)
    keep.scatter_(-1, torch.where(selected >= 0, selected, N), True)
    mask = torch.where(keep[..., :N], 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    w = torch.matmul(query, keys.transpose(2, 3)) * DIMS.scaling + mask[:, None]
    w = torch.softmax(w.float(), dim=-1).to(query.dtype)
    return torch.matmul(w, values)


@pytest.mark.parametrize("chunk", [1, 4, L])
def test_matches_the_dense_expanded_attention_with_gradients(chunk: int) -> None:
    q_pass, q_rot, latent, selected, weight = _inputs(torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q_pass, q_rot, latent, weight)]
    ref_leaves = [t.clone().requires_grad_() for t in (q_pass, q_rot, latent, weight)]
    chunks = [(lo, min(lo + chunk, L)) for lo in range(0, L, chunk)]
    out = latent_attention(*leaves[:3], selected, leaves[3], DIMS, chunks)
    ref = _dense(*ref_leaves[:3], selected, ref_leaves[3])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for name, got, want in zip(("q_pass", "q_rot", "latent", "weight"), leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert float(leaves[2].grad[0].abs().sum()) > 0  # the picked latents got a gradient


def test_gradcheck_float64() -> None:
    q_pass, q_rot, latent, selected, weight = _inputs(torch.float64, seed=1)
    leaves = [t.requires_grad_() for t in (q_pass, q_rot, latent, weight)]

    def fn(qp, qr, lat, w):
        return latent_attention(qp, qr, lat, selected, w, DIMS, [(0, 5), (5, L)])

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_frozen_inputs_get_no_gradient_and_nothing_fails() -> None:
    q_pass, q_rot, latent, selected, weight = _inputs(torch.float32)
    q_pass.requires_grad_()
    out = latent_attention(q_pass, q_rot, latent, selected, weight, DIMS, [(0, L)])
    out.sum().backward()
    assert q_pass.grad is not None and latent.grad is None and weight.grad is None


def test_chunk_rows_bound_the_chunk_at_any_topk() -> None:
    from hp_cp_torch.kernels.latent_attention import CHUNK_ELEMENTS, chunk_rows

    assert chunk_rows(1024, 64, 80, 8) == 1024  # small picks: the configured chunk
    rows = chunk_rows(1024, 2048, 576, 128)  # V3.2's top-k, latent width and heads
    assert 1 <= rows < 1024 and rows * 2048 * (576 + 128) <= CHUNK_ELEMENTS
    assert chunk_rows(1024, 1 << 30, 576, 128) == 1  # never zero rows
