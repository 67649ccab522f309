"""The Triton programs of :mod:`hp_cp_torch.kernels.triton_attention` (imports ``triton``).

Three programs (and a variant of the third), each over a grid ``(B * S, ceil(H / BLOCK_H))``:
one program takes one query row and a block of its heads, and walks that row's column list
``idx[b, s, :]`` in blocks of ``BLOCK_K`` columns. Every head of the row reads the same
gathered KV rows (MQA), so the score block is one ``[BLOCK_H, D] x [D, BLOCK_K]`` product,
as in FlashMLA's sparse kernel:

* ``sparse_attention_fwd``: online softmax whose running max starts at the sink logit
  (``m = sink``, ``l = exp(sink - m) = 1``), so the max includes the sink and an all ``-1``
  row gives 0; writes ``o`` and ``lse = m + log(l)``;
* ``sparse_attention_bwd_dq``: two passes over the columns, the first for
  ``delta = sum_i p_i dp_i`` (``= dO . o``, recomputed instead of saving ``o``), the second
  (``DQ_PASS``) for ``dq = scale * sum_i ds_i kv_i``; writes ``dq`` and ``delta``;
* ``sparse_attention_bwd_dkv``: per column block
  ``dkv = p^T dO + scale * ds^T q`` (summed over the heads of the block) and an atomic add
  into the fp32 pool gradient at the block's rows; duplicates add up, ``-1`` columns are
  masked out. With ``WITH_DQ`` it also accumulates ``dq`` (then the dq kernel runs only its
  ``delta`` pass, ``DQ_PASS=False``): one pass over the columns fewer, more registers;
* ``sparse_attention_bwd_dkv_all_heads`` (tuning ``ALL_HEADS``): the same pool gradient
  from one program per row that sums every head block before its atomic add, so
  ``ceil(H / BLOCK_H)`` times fewer atomics (no dq; the dq kernel makes it).

Only ``tl.load`` / ``tl.store`` / ``tl.dot`` / ``tl.atomic_add`` and elementwise ops are used
(no descriptors, no autotuning), which behave the same from Triton 3.0 on, and in the
interpreter (``TRITON_INTERPRET=1``). The interpreter multiplies 16-bit floats wrongly (it
stores bf16 as raw uint16), so there ``UPCAST`` turns q, dO and the KV rows to fp32 before
the products; on a GPU they stay in their dtype (tensor cores, fp32 accumulation). The
decorators read ``TRITON_INTERPRET`` when this module is imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "sparse_attention_bwd_dkv",
    "sparse_attention_bwd_dkv_all_heads",
    "sparse_attention_bwd_dq",
    "sparse_attention_fwd",
]


@triton.jit
def _row_tile(PTR, off, mask, UPCAST: tl.constexpr):
    """A ``[BLOCK_H, BLOCK_D]`` tile of q or dO (fp32 under the interpreter)."""
    tile = tl.load(PTR + off, mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _column_tile(IDX, kv_base, row, K, k0, offs_k, offs_d, d_ok, D, UPCAST: tl.constexpr):
    """Columns ``k0 .. k0 + BLOCK_K`` of the row's list: ``(valid, KV offsets, KV rows)``;
    ``-1`` and out-of-range columns load zeros."""
    cols = tl.load(IDX + row * K + k0 + offs_k, mask=k0 + offs_k < K, other=-1)
    ok = cols >= 0
    kv_off = cols.to(tl.int64)[:, None] * D + offs_d[None, :]
    kv = tl.load(kv_base + kv_off, mask=ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        kv = kv.to(tl.float32)
    return ok, kv_off, kv


@triton.jit
def _probs_and_dp(q, do, kv, ok, lse, scale, PRECISION: tl.constexpr):
    """The backward's recomputed probabilities ``p`` of one column block (from the saved
    ``lse``) and ``dp = dO kv^T``."""
    s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale
    p = tl.exp(tl.where(ok[None, :], s, float("-inf")) - lse[:, None])
    dp = tl.dot(do, tl.trans(kv), input_precision=PRECISION)
    return p, dp


@triton.jit
def sparse_attention_fwd(
    Q,
    KV,
    IDX,
    SINK,
    OUT,
    LSE,
    scale,
    S,
    P,
    K,
    H,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * S + s
    b = row // S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    hd_ok = h_ok[:, None] & d_ok[None, :]
    q_off = row * H * D + offs_h[:, None] * D + offs_d[None, :]
    q = _row_tile(Q, q_off, hd_ok, UPCAST)
    m = tl.load(SINK + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    l_sum = tl.full([BLOCK_H], 1.0, tl.float32)  # exp(sink - m) with m = sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kv_base = KV + b * P * D
    for k0 in range(0, K, BLOCK_K):
        ok, _, kv = _column_tile(IDX, kv_base, row, K, k0, offs_k, offs_d, d_ok, D, UPCAST)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(OUT + q_off, out.to(OUT.dtype.element_ty), mask=hd_ok)
    tl.store(LSE + row * H + offs_h, m + tl.log(l_sum), mask=h_ok)


@triton.jit
def sparse_attention_bwd_dq(
    Q,
    KV,
    IDX,
    DO,
    LSE,
    DQ,
    DELTA,
    scale,
    S,
    P,
    K,
    H,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    DQ_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    hd_ok = h_ok[:, None] & d_ok[None, :]
    q_off = row * H * D + offs_h[:, None] * D + offs_d[None, :]
    q = _row_tile(Q, q_off, hd_ok, UPCAST)
    do = _row_tile(DO, q_off, hd_ok, UPCAST)
    # padded heads get lse = +inf, so p = 0 there
    lse = tl.load(LSE + row * H + offs_h, mask=h_ok, other=float("inf"))
    kv_base = KV + b * P * D
    delta = tl.zeros([BLOCK_H], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok, _, kv = _column_tile(IDX, kv_base, row, K, k0, offs_k, offs_d, d_ok, D, UPCAST)
        p, dp = _probs_and_dp(q, do, kv, ok, lse, scale, PRECISION)
        delta += tl.sum(p * dp, 1)
    tl.store(DELTA + row * H + offs_h, delta, mask=h_ok)
    if DQ_PASS:  # else the fused dKV kernel computes dq
        dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok, _, kv = _column_tile(IDX, kv_base, row, K, k0, offs_k, offs_d, d_ok, D, UPCAST)
            p, dp = _probs_and_dp(q, do, kv, ok, lse, scale, PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kv.dtype), kv, input_precision=PRECISION)
        tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=hd_ok)


@triton.jit
def sparse_attention_bwd_dkv(
    Q,
    KV,
    IDX,
    DO,
    LSE,
    DELTA,
    DKV,
    DQ,
    scale,
    S,
    P,
    K,
    H,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WITH_DQ: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    hd_ok = h_ok[:, None] & d_ok[None, :]
    q_off = row * H * D + offs_h[:, None] * D + offs_d[None, :]
    q = _row_tile(Q, q_off, hd_ok, UPCAST)
    do = _row_tile(DO, q_off, hd_ok, UPCAST)
    lse = tl.load(LSE + row * H + offs_h, mask=h_ok, other=float("inf"))
    delta = tl.load(DELTA + row * H + offs_h, mask=h_ok, other=0.0)
    kv_base = KV + b * P * D
    dkv_base = DKV + b * P * D
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok, kv_off, kv = _column_tile(IDX, kv_base, row, K, k0, offs_k, offs_d, d_ok, D, UPCAST)
        kd_ok = ok[:, None] & d_ok[None, :]
        p, dp = _probs_and_dp(q, do, kv, ok, lse, scale, PRECISION)
        ds = p * (dp - delta[:, None])
        dkv = tl.dot(tl.trans(p.to(kv.dtype)), do, input_precision=PRECISION)
        dkv += tl.dot(tl.trans((ds * scale).to(kv.dtype)), q, input_precision=PRECISION)
        tl.atomic_add(dkv_base + kv_off, dkv, mask=kd_ok, sem="relaxed")
        if WITH_DQ:
            dq += tl.dot(ds.to(kv.dtype), kv, input_precision=PRECISION)
    if WITH_DQ:
        tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=hd_ok)


@triton.jit
def sparse_attention_bwd_dkv_all_heads(
    Q,
    KV,
    IDX,
    DO,
    LSE,
    DELTA,
    DKV,
    scale,
    S,
    P,
    K,
    H,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The dKV kernel over a grid ``(B * S,)``: per column block, the heads are walked in
    blocks of ``BLOCK_H`` (their q and dO rows reloaded, from cache) and summed in registers
    before one atomic add per pool element, instead of one per head block."""
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_base = KV + b * P * D
    dkv_base = DKV + b * P * D
    for k0 in range(0, K, BLOCK_K):
        ok, kv_off, kv = _column_tile(IDX, kv_base, row, K, k0, offs_k, offs_d, d_ok, D, UPCAST)
        kd_ok = ok[:, None] & d_ok[None, :]
        dkv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            hd_ok = h_ok[:, None] & d_ok[None, :]
            q_off = row * H * D + offs_h[:, None] * D + offs_d[None, :]
            q = _row_tile(Q, q_off, hd_ok, UPCAST)
            do = _row_tile(DO, q_off, hd_ok, UPCAST)
            lse = tl.load(LSE + row * H + offs_h, mask=h_ok, other=float("inf"))
            delta = tl.load(DELTA + row * H + offs_h, mask=h_ok, other=0.0)
            p, dp = _probs_and_dp(q, do, kv, ok, lse, scale, PRECISION)
            ds = p * (dp - delta[:, None])
            dkv += tl.dot(tl.trans(p.to(kv.dtype)), do, input_precision=PRECISION)
            dkv += tl.dot(tl.trans((ds * scale).to(kv.dtype)), q, input_precision=PRECISION)
        tl.atomic_add(dkv_base + kv_off, dkv, mask=kd_ok, sem="relaxed")
