"""The Triton programs of :mod:`hp_cp_torch.kernels.triton_attention` (imports ``triton``).

The attention programs run over a grid ``(B * S, ceil(H / BLOCK_H))``: one program takes
one query row and a block of its heads, and walks that row's column list ``idx[b, s, :]``
in blocks of ``BLOCK_K`` columns. Every head of the row reads the same gathered KV rows
(MQA), so the score block is one ``[BLOCK_H, D] x [D, BLOCK_K]`` product, as in FlashMLA's
sparse kernel:

* ``sparse_attention_fwd_heads_m`` (the default forward): up to 128 heads as M, D in two
  halves, base-2 online softmax whose running max starts at the sink logit;
* ``sparse_attention_fwd`` (the 0.2.0 forward, ``LAYOUT="head_blocks"``): online softmax
  whose running max starts at the sink logit (``m = sink``, ``l = exp(sink - m) = 1``; a
  sink of ``-inf``, which is how no sink arrives, starts at ``l = 0``), so the max includes
  the sink and an all ``-1`` row gives 0; writes ``o`` and ``lse = m + log(l)``. Without a
  sink, an all ``-1`` row has ``l = 0``: it is written as ``o = 0``, ``lse = +inf``
  (exponents taken at a max of 0, Note [Rows that see nothing] in
  :mod:`hp_cp_torch.kernels.softmax`), so backward's ``p = exp(s - lse)`` is 0 there;
* ``sparse_attention_bwd_dq``: two passes over the columns, the first for
  ``delta = sum_i p_i dp_i`` (``= dO . o``, recomputed instead of saving ``o``), the second
  (``DQ_PASS``) for ``dq = scale * sum_i ds_i kv_i``; writes ``dq`` and ``delta``;
* ``sparse_attention_bwd_dkv``: per column block
  ``dkv = p^T dO + scale * ds^T q`` (summed over the heads of the block), stored as the
  head block's part of each column (``STORE_PARTS``) or added atomically into the fp32
  pool gradient at the block's rows; duplicates add up, ``-1`` columns are masked out.
  With ``WITH_DQ`` it also accumulates ``dq`` (then the dq kernel runs only its ``delta``
  pass, ``DQ_PASS=False``): one pass over the columns fewer, more registers. Its grid's
  rows are the chunk ``ROW0 .. ROW0 + ROWS - 1`` of every batch;
* ``sparse_attention_bwd_dkv_all_heads`` (tuning ``ALL_HEADS``): the same pool gradient
  from one program per row that sums every head block before its store or atomic add, so
  ``ceil(H / BLOCK_H)`` times fewer (no dq; the dq kernel makes it);
* ``pool_grad_owned``: one program per pool row and feature block adds the parts of the
  row's readers (plan bands, then the inverted picks) in query order and writes the row
  (Note [Atomics-free pool gradient] in :mod:`hp_cp_torch.kernels.triton_attention`).

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
    "pool_grad_owned",
    "sparse_attention_bwd_dkv",
    "sparse_attention_bwd_dkv_all_heads",
    "sparse_attention_bwd_dq",
    "sparse_attention_fwd",
    "sparse_attention_fwd_heads_m",
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
def _sink_start(SINK, offs_h, h_ok, unit):
    """The online softmax's start for a block of heads: ``(m, l)`` = the sink logit (times
    ``unit``: 1, or log2(e) for a base-2 softmax) and ``exp(sink - m) = 1``; ``l = 0`` for
    a sink of ``-inf`` (no sink)."""
    m = tl.load(SINK + offs_h, mask=h_ok, other=0.0).to(tl.float32) * unit
    return m, (m != float("-inf")).to(tl.float32)


@triton.jit
def _finite(m):
    """The running max to take exponents at: ``m``, or 0 where it is ``-inf`` (the row has
    seen nothing yet and has no sink), so ``exp(-inf - m)`` is 0, never NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _finish(acc, l_sum):
    """The output ``acc / l``, 0 where ``l = 0`` (a row that saw nothing)."""
    return acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]


@triton.jit
def _row_lse(m, l_sum, BASE2: tl.constexpr):
    """``lse = m + log(l)`` in natural log (``m`` in base 2 when ``BASE2``), ``+inf`` where
    ``l = 0`` (a row that saw nothing: backward's ``p = exp(s - lse)`` is 0)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    safe = tl.where(l_sum > 0, l_sum, 1.0)
    if BASE2:
        lse = (m + tl.log2(safe)) / LOG2E
    else:
        lse = m + tl.log(safe)
    return tl.where(l_sum > 0, lse, float("inf"))


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
    m, l_sum = _sink_start(SINK, offs_h, h_ok, 1.0)  # m = sink, l = exp(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kv_base = KV + b * P * D
    for k0 in range(0, K, BLOCK_K):
        ok, _, kv = _column_tile(IDX, kv_base, row, K, k0, offs_k, offs_d, d_ok, D, UPCAST)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_at = _finite(m_new)
        alpha = tl.exp(m - m_at)
        p = tl.exp(s - m_at[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
        m = m_new
    tl.store(OUT + q_off, _finish(acc, l_sum).to(OUT.dtype.element_ty), mask=hd_ok)
    tl.store(LSE + row * H + offs_h, _row_lse(m, l_sum, False), mask=h_ok)


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
    ROW0,
    ROWS,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WITH_DQ: tl.constexpr,
    STORE_PARTS: tl.constexpr,
):
    # programs over the query rows ROW0 .. ROW0 + ROWS - 1 of every batch
    part_row = tl.program_id(0).to(tl.int64)  # b * ROWS + (s - ROW0)
    b = part_row // ROWS
    row = b * S + ROW0 + part_row % ROWS
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
        if STORE_PARTS:  # this head block's share of each column, summed by the owner
            part = (tl.program_id(1) * tl.num_programs(0) + part_row) * K + k0 + offs_k
            part_off = part.to(tl.int64)[:, None] * D + offs_d[None, :]
            tl.store(DKV + part_off, dkv, mask=kd_ok)
        else:
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
    ROW0,
    ROWS,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STORE_PARTS: tl.constexpr,
):
    """The dKV kernel over a grid ``(B * ROWS,)``: per column block, the heads are walked in
    blocks of ``BLOCK_H`` (their q and dO rows reloaded, from cache) and summed in registers
    before one atomic add per pool element (or one store of the row's share, STORE_PARTS),
    instead of one per head block."""
    part_row = tl.program_id(0).to(tl.int64)
    b = part_row // ROWS
    row = b * S + ROW0 + part_row % ROWS
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
        if STORE_PARTS:
            part_off = (part_row * K + k0 + offs_k).to(tl.int64)[:, None] * D + offs_d[None, :]
            tl.store(DKV + part_off, dkv, mask=kd_ok)
        else:
            tl.atomic_add(dkv_base + kv_off, dkv, mask=kd_ok, sem="relaxed")


@triton.jit
def _sum_parts(
    PARTS,
    part_rows,
    cols,
    ok,
    offs_d,
    d_ok,
    K,
    D,
    N_PARTS,
    N_PART_ROWS,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``sum_e sum_p PARTS[p, part_rows[e], cols[e], offs_d]`` over the entries ``ok``: the
    head-block parts of each entry added in order, then the entries (a fixed tree)."""
    mask = ok[:, None] & d_ok[None, :]
    tile = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
    for p in range(N_PARTS):
        flat = ((p * N_PART_ROWS + part_rows) * K + cols).to(tl.int64)
        tile += tl.load(PARTS + flat[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    return tl.sum(tile, 0)


@triton.jit
def pool_grad_owned(
    PARTS,
    DKV,
    OFFSETS,
    QROWS,
    COLS,
    BAND_COL0,
    BAND_START,
    BAND_LEN,
    BAND_FIRST,
    BAND_STOP,
    COL_BASE,
    NB,
    NR,
    ROW0,
    ROWS,
    S,
    P,
    K,
    D,
    N_PARTS,
    N_PART_ROWS,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BANDS: tl.constexpr,
    HAS_CSR: tl.constexpr,
):
    """The pool gradient of one pool row (and ``BLOCK_D`` of its features) from the parts of
    the query rows ``ROW0 .. ROW0 + ROWS - 1``: first its band readers (ranges per band and
    run, from the plan), then its CSR entries (the inverted picks, columns from
    ``COL_BASE``), each in ``BLOCK_E`` blocks, in query order; added to ``DKV`` by this
    program alone (no atomics: bitwise the same every run)."""
    pool_row = tl.program_id(0).to(tl.int64)  # b * P + r
    b = pool_row // P
    r = pool_row % P
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_e = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_D], tl.float32)
    if HAS_BANDS:
        for j in range(NB):
            col0 = tl.load(BAND_COL0 + j)
            for run in range(NR):
                at = (j * NR + run) * P + r
                t0 = tl.maximum(tl.load(BAND_FIRST + at), ROW0)
                t1 = tl.minimum(tl.load(BAND_STOP + at), ROW0 + ROWS)
                for e0 in range(t0, t1, BLOCK_E):
                    t = e0 + offs_e
                    ok = t < t1
                    st = tl.load(BAND_START + j * S + t, mask=ok, other=0)
                    n = tl.load(BAND_LEN + j * S + t, mask=ok, other=0)
                    ok = ok & (r >= st) & (r < st + n)
                    part_rows = b * ROWS + t - ROW0
                    cols = col0 + r - st
                    acc += _sum_parts(PARTS, part_rows, cols, ok, offs_d, d_ok, K, D,
                                      N_PARTS, N_PART_ROWS, BLOCK_E, BLOCK_D)  # fmt: skip
    if HAS_CSR:
        e_lo = tl.load(OFFSETS + pool_row)
        e_hi = tl.load(OFFSETS + pool_row + 1)
        for e0 in range(e_lo, e_hi, BLOCK_E):
            e = e0 + offs_e
            ok = e < e_hi
            part_rows = tl.load(QROWS + e, mask=ok, other=0)
            cols = COL_BASE + tl.load(COLS + e, mask=ok, other=0)
            acc += _sum_parts(PARTS, part_rows, cols, ok, offs_d, d_ok, K, D,
                              N_PARTS, N_PART_ROWS, BLOCK_E, BLOCK_D)  # fmt: skip
    out = DKV + pool_row * D + offs_d
    tl.store(out, tl.load(out, mask=d_ok, other=0.0) + acc, mask=d_ok)


@triton.jit
def sparse_attention_fwd_heads_m(
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
    """The forward with the row's heads as the M dimension of every product (up to 128,
    padded to 16) and the feature dimension in two halves (FlashMLA's split of D = 512
    over two warpgroups): ``s = q_lo kv_lo^T + q_hi kv_hi^T`` and ``o_lo += p kv_lo``,
    ``o_hi += p kv_hi`` from one gather of each KV block; the softmax in base 2 with the
    scale folded into one multiply."""
    LOG2E: tl.constexpr = 1.4426950408889634
    HALF: tl.constexpr = BLOCK_D // 2
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    lo = tl.arange(0, HALF)
    hi = HALF + tl.arange(0, HALF)
    h_ok = offs_h < H
    lo_ok = lo < D
    hi_ok = hi < D
    q_row = row * H * D + offs_h[:, None] * D
    q_lo = _row_tile(Q, q_row + lo[None, :], h_ok[:, None] & lo_ok[None, :], UPCAST)
    q_hi = _row_tile(Q, q_row + hi[None, :], h_ok[:, None] & hi_ok[None, :], UPCAST)
    qk_scale = scale * LOG2E
    m, l_sum = _sink_start(SINK, offs_h, h_ok, LOG2E)  # m = sink, l = 2^(sink - m)
    acc_lo = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF], tl.float32)
    kv_base = KV + b * P * D
    for k0 in range(0, K, BLOCK_K):
        cols = tl.load(IDX + row * K + k0 + offs_k, mask=k0 + offs_k < K, other=-1)
        ok = cols >= 0
        kv_row = kv_base + cols.to(tl.int64)[:, None] * D
        kv_lo = tl.load(kv_row + lo[None, :], mask=ok[:, None] & lo_ok[None, :], other=0.0)
        kv_hi = tl.load(kv_row + hi[None, :], mask=ok[:, None] & hi_ok[None, :], other=0.0)
        if UPCAST:
            kv_lo = kv_lo.to(tl.float32)
            kv_hi = kv_hi.to(tl.float32)
        s = tl.dot(q_lo, tl.trans(kv_lo), input_precision=PRECISION)
        s = tl.dot(q_hi, tl.trans(kv_hi), s, input_precision=PRECISION) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_at = _finite(m_new)
        alpha = tl.exp2(m - m_at)
        p = tl.exp2(s - m_at[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        pv = p.to(kv_lo.dtype)
        acc_lo = tl.dot(pv, kv_lo, acc_lo * alpha[:, None], input_precision=PRECISION)
        acc_hi = tl.dot(pv, kv_hi, acc_hi * alpha[:, None], input_precision=PRECISION)
        m = m_new
    out_row = OUT + q_row
    tl.store(out_row + lo[None, :], _finish(acc_lo, l_sum).to(OUT.dtype.element_ty),
             mask=h_ok[:, None] & lo_ok[None, :])  # fmt: skip
    tl.store(out_row + hi[None, :], _finish(acc_hi, l_sum).to(OUT.dtype.element_ty),
             mask=h_ok[:, None] & hi_ok[None, :])  # fmt: skip
    tl.store(LSE + row * H + offs_h, _row_lse(m, l_sum, True), mask=h_ok)
