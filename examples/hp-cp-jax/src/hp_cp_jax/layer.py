"""A small DeepSeek-V4-style attention layer in JAX: sliding window + compressed slots.

``SparseAttention(r=0)`` is sliding-window attention (SWA), ``r=128`` (or any r > 4) adds
every visible compressed slot (HCA), ``r=4`` adds the indexer's top-k of the visible slots,
whose blocks also read the previous block (CSA). The layer is functional, as JAX code is:
``layer.apply(params, x, cu_seqlens)`` with ``x`` ``[rows, hidden]`` (one sequence, or a
packed stream of documents with global boundaries ``cu_seqlens``). Keys are values.

Per query row t of document [a, b):

* window keys: rows ``max(a, t - W + 1) .. t``;
* slot j of the document compresses rows ``a + j*r .. a + j*r + r - 1`` and is visible to t
  once its last row is ``<= t``; r = 4 keeps the ``topk`` visible slots with the largest
  indexer score ``qi[t] . ik[j]`` (ties: lower slot first).

:meth:`SparseAttention.single_device` computes this from the definition on the whole
sequence; :meth:`SparseAttention.attend_cp` is the same attention from a CP plan's ranges.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hp_cp_core.indices import compressed_index_dense, window_index_dense

Params = dict[str, jax.Array]


class SparseAttention:
    """See the module doc. ``cp_forward`` is set while the layer runs under CP."""

    def __init__(
        self, hidden: int = 8, d: int = 8, *, r: int = 4, window: int = 16, topk: int = 3
    ) -> None:
        self.hidden, self.d, self.r, self.window, self.topk = hidden, d, r, window, topk
        self.cp_forward: Any = None

    def init(self, seed: int = 0) -> Params:
        keys = jax.random.split(jax.random.PRNGKey(seed), 6)
        names = ("wq", "wk", "wqi", "wc", "wci", "wp")
        scale = 1.0 / np.sqrt(self.hidden)
        return {
            n: scale * jax.random.normal(k, (self.hidden, self.d), jnp.float32)
            for n, k in zip(names, keys)
        }

    # -- the layer ---------------------------------------------------------------------------
    def apply(self, params: Params, x: jax.Array, cu_seqlens: Any = None) -> jax.Array:
        """``[rows, d]``; under CP ``x`` is this rank's rows and ``cu_seqlens`` global."""
        if self.cp_forward is not None:
            q, k, qi = self.project(params, x)
            # the parameters reach the compress hooks as call.extra["params"], so that their
            # gradient flows through the CP path (a functional framework has no module state)
            return self.cp_forward(q, k, x, qi, cu_seqlens=cu_seqlens, params=params)
        return self.single_device(params, x, cu_seqlens)

    def project(self, params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return x @ params["wq"], x @ params["wk"], x @ params["wqi"]

    def compress(self, params: Params, rows: jax.Array, pos_offset: int, weight: str) -> jax.Array:
        """Every complete block of r rows -> one slot ``[n, d]`` (0 rows in: 0 slots out); for
        r = 4 a slot also reads the previous block (none before the first); slot j sits at
        position ``pos_offset + j*r``."""
        r = self.r
        n = rows.shape[0] // r
        blocks = rows[: n * r].reshape(n, r, rows.shape[1])
        weights = jnp.arange(1, r + 1, dtype=rows.dtype)[None, :, None]
        own = jnp.tanh(((blocks @ params[weight]) * weights).sum(1))
        if r == 4:
            prev = jnp.concatenate([jnp.zeros_like(blocks[:1]), blocks[:-1]])[:n]
            has_prev = (jnp.arange(n) > 0)[:, None].astype(rows.dtype)
            own = own + 0.5 * jnp.tanh((prev @ params["wp"]).sum(1)) * has_prev
        pos = pos_offset + r * jnp.arange(n, dtype=rows.dtype)
        return own + 0.01 * jnp.cos(pos)[:, None]

    # -- one device, from the definition -------------------------------------------------------
    def single_device(self, params: Params, x: jax.Array, cu_seqlens: Any = None) -> jax.Array:
        n, r, w = x.shape[0], self.r, self.window
        q, k, qi = self.project(params, x)
        cu = np.array([0, n] if cu_seqlens is None else cu_seqlens, dtype=np.int64)
        doc = np.repeat(np.arange(cu.size - 1), np.diff(cu))
        t = np.arange(n)
        win = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
        win &= t[None, :] > t[:, None] - w
        logits, values = [_masked(q @ k.T, win)], [k]
        if r > 0:
            kv, ik, last, sdoc = [], [], [], []
            for i in range(cu.size - 1):
                a, b = int(cu[i]), int(cu[i + 1])
                m = (b - a) // r
                kv.append(self.compress(params, x[a:b], 0, "wc"))
                ik.append(self.compress(params, x[a:b], 0, "wci"))
                last.extend(a + r * (j + 1) - 1 for j in range(m))
                sdoc.extend([i] * m)
            kv_all, ik_all = jnp.concatenate(kv), jnp.concatenate(ik)
            vis = (np.array(sdoc, dtype=np.int64)[None, :] == doc[:, None]) & (
                np.array(last, dtype=np.int64)[None, :] <= t[:, None]
            )
            if r == 4 and vis.shape[1]:
                scores = _masked(qi @ ik_all.T, vis)
                _, top = jax.lax.top_k(scores, min(self.topk, vis.shape[1]))
                picked = np.zeros_like(vis)
                picked[np.arange(n)[:, None], np.asarray(top)] = True
                vis = vis & picked
            logits.append(_masked(q @ kv_all.T, vis))
            values.append(kv_all)
        p = jax.nn.softmax(jnp.concatenate(logits, axis=1), axis=1)
        return p @ jnp.concatenate(values)

    # -- under CP, from the plan's ranges --------------------------------------------------------
    def attend_cp(self, query: jax.Array, ori_ext: jax.Array, qr: jax.Array, call: Any):
        """The same attention for the local queries: window keys are ranges of ``ori_ext``,
        visible slots ranges of the gathered ``call.cmp_kv_global`` (see the backend guide)."""
        plan = call.plan
        win = window_index_dense(plan.window_start, plan.window_len, self.window)
        keys = [_rows(ori_ext, win)]
        masks = [win >= 0]
        width = int(plan.cmp_count.max()) if plan.cmp_count.size else 0
        if self.r > 0 and width:
            cols = compressed_index_dense(plan.cmp_start, plan.cmp_count, width)
            vis = cols >= 0
            if self.r == 4:
                ik = _rows(call.cmp_idx_global, cols)
                scores = _masked(jnp.einsum("nd,nkd->nk", qr, ik), vis)
                _, top = jax.lax.top_k(scores, min(self.topk, width))
                top = np.asarray(top)
                cols = np.take_along_axis(cols, top, axis=1)
                vis = np.take_along_axis(vis, top, axis=1)
            keys.append(_rows(call.cmp_kv_global, cols))
            masks.append(vis)
        k = jnp.concatenate(keys, axis=1)  # [n, W + k, d]
        logits = _masked(jnp.einsum("nd,nkd->nk", query, k), np.concatenate(masks, axis=1))
        p = jax.nn.softmax(logits, axis=1)
        return jnp.einsum("nk,nkd->nd", p, k)


def _masked(scores: jax.Array, mask: np.ndarray) -> jax.Array:
    return jnp.where(jnp.asarray(mask), scores, -jnp.inf)


def _rows(table: jax.Array, index: np.ndarray) -> jax.Array:
    """``table[index]`` with -1 (padding) read as row 0 (masked by the caller)."""
    return table[jnp.asarray(np.maximum(index, 0))]
