"""Each CPU stand-in of ``mf_model_standins`` (the whole model's MoE and MTP operations) equals its
documented formula, computed here with numpy: values, and gradients where the model
differentiates through it. The originals have no CPU kernel (forward or backward), so only
``softplus``'s forward can be compared with the original."""

from __future__ import annotations

import numpy as np
import pytest
from mf_require import mindspore_or_skip

ms = mindspore_or_skip()

import mf_model_standins as sub  # noqa: E402
from mindspore import Tensor, mint  # noqa: E402
from mindspore import dtype as mstype  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

RNG = np.random.default_rng(0)


@pytest.mark.parametrize(
    ("values", "bins", "lo", "hi"),
    [([0, 3, 1, 3, 3, 2], 4, 0, 4), ([1.0, 2, 1], 4, 0, 3), ([0.5, -1, 7, 2.5], 3, 0, 3)],
)
def test_histc_counts_equal_width_bins(values: list, bins: int, lo: float, hi: float) -> None:
    got = sub.histc(Tensor(np.array(values)), bins=bins, min=lo, max=hi)
    edges = np.linspace(lo, hi, bins + 1)
    want = [
        sum(1 for v in values if a <= v < b or (k == bins - 1 and v == b))
        for k, (a, b) in enumerate(zip(edges[:-1], edges[1:]))
    ]
    assert got.dtype == mstype.float32
    np.testing.assert_array_equal(got.asnumpy(), want)


def test_histc_documented_example() -> None:
    got = sub.histc(Tensor(np.array([1.0, 2, 1], np.float32)), bins=4, min=0, max=3)
    np.testing.assert_array_equal(got.asnumpy(), [0, 2, 1, 0])  # mint.histc's docstring


def test_cumsum() -> None:
    x = np.array([3, 0, 2, 5], np.int64)
    got = sub.cumsum(Tensor(x), 0, dtype=mstype.int64)
    assert got.dtype == mstype.int64
    np.testing.assert_array_equal(got.asnumpy(), np.cumsum(x))


@pytest.mark.parametrize("counts", [[2, 0, 3, 1], [0, 0, 6, 0], [1, 2, 1, 2]])
def test_grouped_matmul_values_and_gradients(counts: list) -> None:
    x = RNG.standard_normal((6, 5)).astype(np.float32)
    w = RNG.standard_normal((4, 5, 3)).astype(np.float32)
    cot = RNG.standard_normal((6, 3)).astype(np.float32)
    ends = Tensor(np.cumsum(counts).astype(np.int64))
    group = np.repeat(np.arange(4), counts)  # row -> its expert
    want = np.einsum("mk,mkn->mn", x, w[group])

    def f(a, b):
        out = sub.GroupedMatmul(split_item=3, group_type=0)(
            [a], [b], None, None, None, None, None, ends
        )[0]
        return (out * Tensor(cot)).sum(), out

    (_, out), (gx, gw) = ms.value_and_grad(f, (0, 1), has_aux=True)(Tensor(x), Tensor(w))
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        gx.asnumpy(), np.einsum("mn,mkn->mk", cot, w[group]), rtol=1e-5, atol=1e-5
    )
    want_gw = np.zeros_like(w)
    for m, e in enumerate(group):
        want_gw[e] += np.outer(x[m], cot[m])
    np.testing.assert_allclose(gw.asnumpy(), want_gw, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(NotImplementedError, match="split_item=3, group_type=0"):
        sub.GroupedMatmul(split_item=0, group_type=-1)


def test_moe_token_permute_documented_example() -> None:
    tokens = np.array([[1] * 3, [7] * 3, [2] * 3, [1] * 3, [2] * 3, [3] * 3], np.float32)
    out, where = sub.moe_token_permute(
        Tensor(tokens), Tensor(np.array([5, 0, 3, 1, 2, 4], np.int32))
    )
    np.testing.assert_array_equal(out.asnumpy()[:, 0], [7, 1, 2, 2, 3, 1])  # the docstring's
    np.testing.assert_array_equal(where.asnumpy(), [5, 0, 3, 1, 2, 4])
    assert where.dtype == mstype.int32


def test_permute_then_unpermute_is_the_weighted_sum_over_experts() -> None:
    """``unpermute(f(permute(t)), probs)[n] = sum_k probs[n, k] * f(t[n])_{expert[n, k]}``,
    with rows grouped by expert (stable: ties keep token order); gradients too."""
    n, k, d, experts = 7, 2, 4, 3
    tokens = RNG.standard_normal((n, d)).astype(np.float32)
    idx = np.stack([RNG.permutation(experts)[:k] for _ in range(n)]).astype(np.int64)
    probs = RNG.random((n, k)).astype(np.float32)
    scale = RNG.standard_normal((n * k, 1)).astype(np.float32)  # a per-row "expert" output
    cot = RNG.standard_normal((n, d)).astype(np.float32)
    order = np.argsort(idx.reshape(-1), kind="stable")

    def f(t, p):
        permuted, where = sub.moe_token_permute(t, Tensor(idx))
        out = sub.moe_token_unpermute(permuted * Tensor(scale), where, p)
        return (out * Tensor(cot)).sum(), (permuted, out)

    (_, (permuted, out)), (gt, gp) = ms.value_and_grad(f, (0, 1), has_aux=True)(
        Tensor(tokens), Tensor(probs)
    )
    np.testing.assert_array_equal(permuted.asnumpy(), tokens[order // k])
    assert (np.diff(idx.reshape(-1)[order]) >= 0).all()
    row_scale = np.empty(n * k, np.float32)
    row_scale[order] = scale[:, 0]  # flattened entry -> its permuted row's factor
    weight = probs * row_scale.reshape(n, k)
    np.testing.assert_allclose(out.asnumpy(), tokens * weight.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(gt.asnumpy(), cot * weight.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(
        gp.asnumpy(), (cot * tokens).sum(1, keepdims=True) * row_scale.reshape(n, k), rtol=1e-5
    )


def test_softplus_equals_the_original_forward_and_its_derivative() -> None:
    x = np.array([-30.0, -3, -0.5, 0, 0.5, 3, 19, 25], np.float32)
    got = sub.softplus(Tensor(x))
    np.testing.assert_allclose(
        got.asnumpy(), mint.nn.functional.softplus(Tensor(x)).asnumpy(), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        got.asnumpy(), np.where(x > 20, x, np.log1p(np.exp(x))), rtol=1e-6, atol=1e-6
    )
    grad = ms.grad(lambda t: sub.softplus(t).sum())(Tensor(x)).asnumpy()
    np.testing.assert_allclose(
        grad, np.where(x > 20, 1.0, 1 / (1 + np.exp(-x))), rtol=1e-5, atol=1e-7
    )


def test_zeros_like_scatter_add_and_clone() -> None:
    z = sub.zeros_like(Tensor(np.ones((2, 3), np.int32)), dtype=mstype.float32)
    assert z.dtype == mstype.float32 and not z.asnumpy().any()
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    index = np.array([[1, 1], [0, 3], [2, 2]], np.int64)
    src = RNG.standard_normal((3, 2)).astype(np.float32)
    want = x.copy()
    for i in range(3):
        for j in range(2):
            want[i, index[i, j]] += src[i, j]  # duplicates accumulate
    got = sub.scatter_add(Tensor(x), 1, Tensor(index), Tensor(src)).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    t = Tensor(x)
    c = sub.clone(t)
    assert c is not t
    np.testing.assert_array_equal(c.asnumpy(), x)
