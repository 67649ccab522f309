"""Each CPU stand-in of ``mf_cpu_standins`` equals what it replaces: the original operation on
inputs where both run on CPU (``mint.split``'s forward), else the documented formula (numpy)."""

from __future__ import annotations

import numpy as np
import pytest
from mf_require import mindspore_or_skip

ms = mindspore_or_skip()

import mf_cpu_standins as sub  # noqa: E402
from mindspore import Tensor, mint  # noqa: E402
from mindspore import dtype as mstype  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

RNG = np.random.default_rng(0)


def test_every_replaced_operation_is_covered() -> None:
    assert set(sub.MINT) == {
        "arange",
        "full",
        "roll",
        "topk",
        "stack",
        "ones_like",
        "index_select",
        "split",
        "tril",
        "outer",
    }


@pytest.mark.parametrize("args", [(5,), (1, 6), (3, 11, 2)])
def test_arange(args: tuple) -> None:
    got = sub.arange(*args, dtype=mstype.int32)
    assert got.dtype == mstype.int32
    np.testing.assert_array_equal(got.asnumpy(), np.arange(*args))
    assert sub.arange(4).dtype == mstype.int64


def test_full() -> None:
    got = sub.full((2, 3), float("-inf"), dtype=mstype.float32).asnumpy()
    np.testing.assert_array_equal(got, np.full((2, 3), -np.inf, np.float32))
    np.testing.assert_array_equal(sub.full(4, -1, dtype=mstype.int32).asnumpy(), [-1] * 4)


@pytest.mark.parametrize("shift", [0, 1, 3, 5])
def test_roll(shift: int) -> None:
    x = RNG.standard_normal((5, 2, 3)).astype(np.float32)
    np.testing.assert_array_equal(sub.roll(Tensor(x), shift, 0).asnumpy(), np.roll(x, shift, 0))


def test_topk_values_indices_ties_and_gradient() -> None:
    x = np.array([[0.5, 2.0, 2.0, -1.0, 3.0], [1.0, 1.0, 1.0, 0.0, -np.inf]], np.float32)
    values, index = sub.topk(Tensor(x), 3)
    np.testing.assert_array_equal(index.asnumpy(), [[4, 1, 2], [0, 1, 2]])  # ties: lower first
    np.testing.assert_array_equal(values.asnumpy(), np.take_along_axis(x, index.asnumpy(), -1))
    w = RNG.standard_normal((2, 3)).astype(np.float32)
    y = np.abs(RNG.standard_normal((2, 5))).astype(np.float32)
    grad = ms.grad(lambda t: (sub.topk(t, 3)[0] * Tensor(w)).sum())(Tensor(y)).asnumpy()
    want = np.zeros_like(y)
    np.put_along_axis(want, np.argsort(-y, -1, kind="stable")[:, :3], w, -1)
    np.testing.assert_allclose(grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("diagonal", [0, 1, -1])
def test_tril(diagonal: int) -> None:
    x = RNG.standard_normal((4, 5)).astype(np.float32)
    np.testing.assert_array_equal(sub.tril(Tensor(x), diagonal).asnumpy(), np.tril(x, diagonal))


def test_outer() -> None:
    a, b = RNG.standard_normal(3).astype(np.float32), RNG.standard_normal(4).astype(np.float32)
    np.testing.assert_allclose(sub.outer(Tensor(a), Tensor(b)).asnumpy(), np.outer(a, b), rtol=1e-6)


def test_stack_ones_like_index_select() -> None:
    a, b = (RNG.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    np.testing.assert_array_equal(
        sub.stack([Tensor(a), Tensor(b)], 1).asnumpy(), np.stack([a, b], 1)
    )
    np.testing.assert_array_equal(sub.ones_like(Tensor(a)).asnumpy(), np.ones_like(a))
    index = np.array([2, 0, 2], np.int32)
    np.testing.assert_array_equal(
        sub.index_select(Tensor(a), 1, Tensor(index)).asnumpy(), np.take(a, index, 1)
    )


@pytest.mark.parametrize("sections", [[2, 3, 3], 3])
def test_split_forward_equals_mint_split_and_backward_is_right(sections) -> None:
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    got = sub.split(Tensor(x), sections, dim=-1)
    want = mint.split(Tensor(x), sections, dim=-1)  # the forward runs on CPU
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
    # d/dx sum_i sum(part_i * c_i) = the c_i laid side by side
    cots = [RNG.standard_normal(tuple(p.shape)).astype(np.float32) for p in got]
    grad = ms.grad(
        lambda t: sum((p * Tensor(c)).sum() for p, c in zip(sub.split(t, sections, -1), cots))
    )(Tensor(x)).asnumpy()
    np.testing.assert_array_equal(grad, np.concatenate(cots, -1))


def test_rms_norm_formula() -> None:
    x = RNG.standard_normal((3, 2, 8)).astype(np.float32)
    gamma = RNG.standard_normal(8).astype(np.float32)
    out, rstd = sub.rms_norm(Tensor(x), Tensor(gamma), 1e-5)
    want_rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(rstd.asnumpy(), want_rstd, rtol=1e-6)
    np.testing.assert_allclose(out.asnumpy(), x * want_rstd * gamma, rtol=1e-5, atol=1e-6)


def test_detach_stops_the_gradient() -> None:
    x = Tensor(np.ones(3, np.float32))
    grad = ms.grad(lambda t: (sub.detach(t) * t).sum())(x).asnumpy()
    np.testing.assert_array_equal(grad, np.ones(3))  # only the non-detached factor
